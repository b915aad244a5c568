// The middle of repeated measurements, which a busy machine's one slow run
// does not move.
#pragma once

#include <algorithm>
#include <vector>

namespace tpipe {

inline double median(std::vector<double> values) {
  if (values.empty())
    return 0.0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

} // namespace tpipe

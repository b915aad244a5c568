// Figures of repeated measurements that a busy machine's one slow run does
// not move.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace tpipe {

inline double median(std::vector<double> values) {
  if (values.empty())
    return 0.0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// The time a step takes on average, as a run meets it: a neighbour's
// bursts included, in the share of the steps they slowed.
inline double mean(const std::vector<double>& values) {
  double sum = 0.0;
  for (double v : values)
    sum += v;
  return values.empty() ? 0.0 : sum / static_cast<double>(values.size());
}

// How closely repeated measurements pin their mean: its standard error
// over the mean. A neighbour's bursts make a plan's rounds spread by a
// third or more, and their mean settles only over many of them.
inline double relativeStandardError(const std::vector<double>& values) {
  if (values.size() < 2)
    return 0.0;
  const double average = mean(values);
  double squares = 0.0;
  for (double v : values)
    squares += (v - average) * (v - average);
  const double n = static_cast<double>(values.size());
  const double error = std::sqrt(squares / (n - 1.0)) / std::sqrt(n);
  return average > 0.0 ? error / average : 0.0;
}

// The lower quartile: a step on a quiet machine. A neighbour's burst only
// ever adds time, and it may cover half of one plan's steps and none of
// another's; the lower quartile is the step most of them could have had.
inline double lowerQuartile(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0.0 : values[(values.size() - 1) / 4];
}

// Relative spread of repeated measurements: the median absolute deviation
// over the median. Robust to the one step a busy machine stretches.
inline double relativeSpread(const std::vector<double>& values) {
  if (values.size() < 2)
    return 0.0;
  const double middle = median(values);
  std::vector<double> deviations;
  for (double v : values)
    deviations.push_back(std::abs(v - middle));
  return middle > 0.0 ? median(deviations) / middle : 0.0;
}

} // namespace tpipe

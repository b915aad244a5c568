// Training curves as a picture: `tpipe train --plot` and `tpipe plot`.
#pragma once

#include <string>

namespace tpipe {

// An SVG of a run's metrics (the JSON lines of `tpipe train --metrics`):
// training loss and evaluation loss against step, evaluation accuracy on a
// right-hand axis when there is one, and samples/s below; axes with ticks, a
// legend, and `title` (the config's name) on top. Lines that are not JSON
// objects are skipped (a file still being written ends mid-line); a later
// record of a step replaces an earlier one (a resumed run redid it).
std::string curvesSvg(
    const std::string& metricsLines,
    const std::string& title);

// Whether metrics lines hold a record (a JSON object with a numeric "step"),
// or are still empty or mid-line (a run before its first record): false for
// complete lines of something else, such as a config named by mistake.
bool holdsMetricsRecords(const std::string& metricsLines);

} // namespace tpipe

// Training curves from metrics JSON lines, drawn as SVG by hand: two panels
// sharing the step axis, each with "nice" ticks (1, 2, 5 x 10^k).
#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <map>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "tpipe/curves.h"

namespace tpipe {
namespace {

using Series = std::map<double, double>; // step -> value

struct Curves {
  Series loss, evalLoss, evalAccuracy, samplesPerSecond;
};

bool isMetricsRecord(const nlohmann::json& record) {
  return record.is_object() && record.contains("step") &&
      record["step"].is_number();
}

Curves readCurves(const std::string& lines) {
  Curves curves;
  std::istringstream in(lines);
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json record = nlohmann::json::parse(line, nullptr, false);
    if (!isMetricsRecord(record))
      continue;
    const double step = record["step"].get<double>();
    auto take = [&](const char* key, Series& series) {
      if (record.contains(key) && record[key].is_number() &&
          std::isfinite(record[key].get<double>()))
        series[step] = record[key].get<double>();
    };
    take("loss", curves.loss);
    take("samples_per_s", curves.samplesPerSecond);
    take("eval_loss", curves.evalLoss);
    take("eval_accuracy", curves.evalAccuracy);
  }
  return curves;
}

// Ticks at 1, 2 or 5 x 10^k covering [low, high], about `count` of them.
// Losses from a diverged run reach 1e308 and -1e308: the span is taken in
// halves so that it cannot overflow, and where no such step exists (a span
// lost in rounding, or past the largest double) the ends are the ticks.
std::vector<double> niceTicks(double low, double high, int count) {
  if (!(high > low))
    high = low + 1;
  std::vector<double> ticks;
  const double raw = (high / 2 - low / 2) / std::max(count, 1) * 2;
  if (std::isfinite(raw) && raw > 0) {
    const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
    double step = magnitude;
    for (double factor : {1.0, 2.0, 5.0, 10.0}) {
      step = factor * magnitude;
      if (step >= raw)
        break;
    }
    const double first = std::ceil(low / step),
                 last = std::floor(high / step + 1e-9);
    if (std::isfinite(step) && last - first >= 0 && last - first <= 4 * count)
      for (int i = 0; i <= static_cast<int>(last - first); ++i) {
        const double t = (first + i) * step;
        if (ticks.empty() || t > ticks.back())
          ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
      }
  }
  if (ticks.empty()) {
    ticks.push_back(low);
    if (high > low)
      ticks.push_back(high);
  }
  return ticks;
}

std::string tickText(double value) {
  std::ostringstream text;
  if (std::abs(value) >= 1e7 || (value != 0 && std::abs(value) < 1e-3))
    text << std::setprecision(2) << value;
  else if (value == std::round(value))
    text << std::fixed << std::setprecision(0) << value;
  else
    text << std::setprecision(6) << value;
  return text.str();
}

struct Range {
  double low = std::numeric_limits<double>::infinity();
  double high = -std::numeric_limits<double>::infinity();
  void add(const Series& series) {
    for (const auto& [x, y] : series) {
      (void)x;
      low = std::min(low, y), high = std::max(high, y);
    }
  }
  bool empty() const {
    return low > high;
  }
};

// One panel: a box at (left, top, width, height) mapping [x0, x1] x [y0, y1].
struct Panel {
  double left, top, width, height;
  double x0, x1, y0, y1;
  double x(double step) const {
    return left + fraction(step, x0, x1) * width;
  }
  double y(double value) const {
    return top + height - fraction(value, y0, y1) * height;
  }
  // Where v lies in [low, high], from 0 to 1; halved, as in niceTicks, so
  // that opposite huge values do not overflow.
  static double fraction(double v, double low, double high) {
    return (v / 2 - low / 2) / std::max(high / 2 - low / 2, 1e-12);
  }
};

void drawFrame(
    std::ostream& svg,
    const Panel& p,
    const std::vector<double>& xTicks,
    const std::vector<double>& yTicks,
    const std::string& yLabel) {
  svg << "<rect x=\"" << p.left << "\" y=\"" << p.top << "\" width=\""
      << p.width << "\" height=\"" << p.height
      << "\" fill=\"none\" stroke=\"#999\"/>\n";
  for (double t : yTicks) {
    svg << "<line class=\"grid\" x1=\"" << p.left << "\" x2=\""
        << p.left + p.width << "\" y1=\"" << p.y(t) << "\" y2=\"" << p.y(t)
        << "\" stroke=\"#e4e4e4\"/>\n";
    svg << "<text x=\"" << p.left - 6 << "\" y=\"" << p.y(t) + 4
        << "\" text-anchor=\"end\">" << tickText(t) << "</text>\n";
  }
  for (double t : xTicks) {
    svg << "<line x1=\"" << p.x(t) << "\" x2=\"" << p.x(t) << "\" y1=\""
        << p.top + p.height << "\" y2=\"" << p.top + p.height + 5
        << "\" stroke=\"#999\"/>\n";
    svg << "<text x=\"" << p.x(t) << "\" y=\"" << p.top + p.height + 18
        << "\" text-anchor=\"middle\">" << tickText(t) << "</text>\n";
  }
  svg << "<text transform=\"translate(" << p.left - 52 << ","
      << p.top + p.height / 2 << ") rotate(-90)\" text-anchor=\"middle\">"
      << yLabel << "</text>\n";
}

void drawSeries(
    std::ostream& svg,
    const Panel& p,
    const Series& series,
    const char* name,
    const char* colour,
    bool dots) {
  if (series.empty())
    return;
  svg << "<polyline class=\"" << name << "\" fill=\"none\" stroke=\"" << colour
      << "\" stroke-width=\"2\" points=\"";
  for (const auto& [step, value] : series)
    svg << p.x(step) << ',' << p.y(value) << ' ';
  svg << "\"/>\n";
  if (dots) {
    for (const auto& [step, value] : series) {
      svg << "<circle cx=\"" << p.x(step) << "\" cy=\"" << p.y(value)
          << "\" r=\"3.5\" fill=\"" << colour << "\"/>\n";
    }
  }
}

std::string escaped(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

} // namespace

std::string curvesSvg(
    const std::string& metricsLines,
    const std::string& title) {
  const Curves c = readCurves(metricsLines);
  constexpr double kWidth = 900, kLeft = 80, kRight = 80, kTop = 60;
  constexpr double kLossHeight = 300, kGap = 60, kRateHeight = 140;
  std::ostringstream svg;
  svg << std::fixed << std::setprecision(2);
  const double height = kTop + kLossHeight + kGap + kRateHeight + 70;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth
      << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  svg << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  svg << "<text x=\"" << kLeft
      << "\" y=\"28\" font-size=\"16\" font-weight=\"bold\">" << escaped(title)
      << "</text>\n";
  if (c.loss.empty() && c.evalLoss.empty()) {
    svg << "<text x=\"" << kLeft << "\" y=\"" << kTop + 20
        << "\">no training records yet</text>\n</svg>\n";
    return svg.str();
  }
  double firstStep = std::numeric_limits<double>::infinity(), lastStep = 0;
  for (const Series* s : {&c.loss, &c.evalLoss, &c.samplesPerSecond}) {
    if (!s->empty()) {
      firstStep = std::min(firstStep, s->begin()->first);
      lastStep = std::max(lastStep, s->rbegin()->first);
    }
  }
  const std::vector<double> xTicks =
      niceTicks(std::min(firstStep, 0.0), lastStep, 8);
  const double x0 = std::min(firstStep, 0.0),
               x1 = std::max(lastStep, xTicks.back());
  const double plotWidth = kWidth - kLeft - kRight;

  Range loss;
  loss.add(c.loss);
  loss.add(c.evalLoss);
  const std::vector<double> lossTicks =
      niceTicks(std::min(loss.low, 0.0), loss.high, 5);
  const Panel lossPanel{
      kLeft,
      kTop,
      plotWidth,
      kLossHeight,
      x0,
      x1,
      std::min(loss.low, 0.0),
      std::max(loss.high, lossTicks.back())};
  drawFrame(svg, lossPanel, xTicks, lossTicks, "loss");
  drawSeries(svg, lossPanel, c.loss, "loss", "#1f77b4", false);
  drawSeries(svg, lossPanel, c.evalLoss, "eval-loss", "#ff7f0e", true);
  if (!c.evalAccuracy.empty()) {
    const Panel accuracy{kLeft, kTop, plotWidth, kLossHeight, x0, x1, 0.0, 1.0};
    for (double t : niceTicks(0, 1, 5)) {
      svg << "<text x=\"" << kLeft + plotWidth + 6 << "\" y=\""
          << accuracy.y(t) + 4 << "\" fill=\"#2ca02c\">" << tickText(t)
          << "</text>\n";
    }
    svg << "<text transform=\"translate(" << kLeft + plotWidth + 50 << ","
        << kTop + kLossHeight / 2
        << ") rotate(90)\" text-anchor=\"middle\" fill=\"#2ca02c\">eval accuracy</text>\n";
    drawSeries(svg, accuracy, c.evalAccuracy, "eval-accuracy", "#2ca02c", true);
  }

  if (!c.samplesPerSecond.empty()) {
    Range rate;
    rate.add(c.samplesPerSecond);
    const std::vector<double> rateTicks = niceTicks(0.0, rate.high, 3);
    const Panel ratePanel{
        kLeft,
        kTop + kLossHeight + kGap,
        plotWidth,
        kRateHeight,
        x0,
        x1,
        0.0,
        std::max(rate.high, rateTicks.back())};
    drawFrame(svg, ratePanel, xTicks, rateTicks, "samples/s");
    drawSeries(
        svg, ratePanel, c.samplesPerSecond, "samples-per-s", "#9467bd", false);
  }
  svg << "<text x=\"" << kLeft + plotWidth / 2 << "\" y=\"" << height - 20
      << "\" text-anchor=\"middle\">step</text>\n";

  // Legend: one row between the title and the loss panel.
  struct Entry {
    const char* name;
    const char* colour;
    bool shown;
  };
  double x = kLeft;
  for (const Entry& e :
       {Entry{"training loss", "#1f77b4", !c.loss.empty()},
        Entry{"eval loss", "#ff7f0e", !c.evalLoss.empty()},
        Entry{"eval accuracy (right axis)", "#2ca02c", !c.evalAccuracy.empty()},
        Entry{"samples/s (below)", "#9467bd", !c.samplesPerSecond.empty()}}) {
    if (!e.shown)
      continue;
    const double y = kTop - 14;
    svg << "<line x1=\"" << x << "\" x2=\"" << x + 22 << "\" y1=\"" << y - 4
        << "\" y2=\"" << y - 4 << "\" stroke=\"" << e.colour
        << "\" stroke-width=\"3\"/>\n";
    svg << "<text x=\"" << x + 28 << "\" y=\"" << y << "\">" << e.name
        << "</text>\n";
    x += 40 + 6.5 * std::string(e.name).size();
  }
  svg << "</svg>\n";
  return svg.str();
}

bool holdsMetricsRecords(const std::string& metricsLines) {
  std::istringstream in(metricsLines);
  std::string line;
  bool completeLine = false;
  while (std::getline(in, line)) {
    completeLine = completeLine || !in.eof();
    if (isMetricsRecord(nlohmann::json::parse(line, nullptr, false)))
      return true;
  }
  return !completeLine;
}

} // namespace tpipe

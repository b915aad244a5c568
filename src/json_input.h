// Reading JSON that users hand over (configs, profiles, schedule files,
// checkpoint pointers): bounded nesting, and errors in tpipe's own words.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace tpipe {

// Deeper documents are refused: printing or freeing one recurses per level.
constexpr int kMaxJsonDepth = 64;

// Throws ConfigError starting with `what` (a path or an option): not JSON
// (with line and column), or nested deeper than kMaxJsonDepth.
nlohmann::json parseJsonText(
    const std::string& text,
    const std::string& what,
    bool allowComments = false);

// Reads and parses a file; ConfigError when it cannot be read.
nlohmann::json readJsonFile(
    const std::string& path,
    const std::string& what,
    bool allowComments = false);

// The first key path at which two JSON values differ ("train.seed",
// "model.layers[3].out_features"), or "" when they are equal.
std::string firstDifference(
    const nlohmann::json& a,
    const nlohmann::json& b,
    const std::string& path = "");

} // namespace tpipe

#include "json_input.h"

#include <fstream>
#include <sstream>

#include "tpipe/errors.h"

namespace tpipe {
namespace {

// "[json.exception.parse_error.101] parse error at line 2, column 3: ..." ->
// "parse error at line 2, column 3: ...".
std::string withoutLibraryPrefix(const std::string& message) {
  const size_t close = message.find("] ");
  return message.rfind("[json.exception.", 0) == 0 && close != std::string::npos
      ? message.substr(close + 2)
      : message;
}

struct TooDeep {};

} // namespace

nlohmann::json parseJsonText(
    const std::string& text,
    const std::string& what,
    bool allowComments) {
  const nlohmann::json::parser_callback_t depthLimit =
      [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        if (depth > kMaxJsonDepth)
          throw TooDeep{};
        return true;
      };
  try {
    return nlohmann::json::parse(text, depthLimit, true, allowComments);
  } catch (const TooDeep&) {
    throw ConfigError(
        what + ": nested deeper than " + std::to_string(kMaxJsonDepth) +
        " levels");
  } catch (const nlohmann::json::exception& error) {
    throw ConfigError(
        what + ": not valid JSON: " + withoutLibraryPrefix(error.what()));
  }
}

nlohmann::json readJsonFile(
    const std::string& path,
    const std::string& what,
    bool allowComments) {
  std::ifstream file(path, std::ios::binary);
  if (!file)
    throw ConfigError(what + ": cannot open " + path);
  std::ostringstream text;
  text << file.rdbuf();
  if (file.bad())
    throw ConfigError(what + ": cannot read " + path);
  return parseJsonText(text.str(), what, allowComments);
}

std::string firstDifference(
    const nlohmann::json& a,
    const nlohmann::json& b,
    const std::string& path) {
  if (a.type() != b.type())
    return path.empty() ? "(the whole value)" : path;
  if (a.is_object()) {
    for (const auto& item : a.items()) {
      const std::string key =
          path.empty() ? item.key() : path + "." + item.key();
      if (!b.contains(item.key()))
        return key;
      const std::string inner =
          firstDifference(item.value(), b.at(item.key()), key);
      if (!inner.empty())
        return inner;
    }
    for (const auto& item : b.items()) {
      if (!a.contains(item.key()))
        return path.empty() ? item.key() : path + "." + item.key();
    }
    return "";
  }
  if (a.is_array()) {
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      const std::string inner =
          firstDifference(a[i], b[i], path + "[" + std::to_string(i) + "]");
      if (!inner.empty())
        return inner;
    }
    return a.size() == b.size() ? "" : path;
  }
  return a == b ? "" : (path.empty() ? "(the whole value)" : path);
}

} // namespace tpipe

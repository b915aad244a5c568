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

} // namespace tpipe

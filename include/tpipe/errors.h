// The two tiers of errors.
//
// UserError: something the user handed tpipe is wrong (a config, a shape, a
// device name, a file, a peer, a schedule file). The message names the
// offending key or value; every tpipe command exits 2 on it. Anything else
// (a broken internal invariant, TORCH_INTERNAL_ASSERT, a runtime failure of
// a step) exits 1. Only `main` turns errors into exit codes.
#pragma once

#include <stdexcept>

namespace tpipe {

class UserError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A config, a profile or another file the user names: the message starts
// with the JSON path or the option.
class ConfigError : public UserError {
 public:
  using UserError::UserError;
};

} // namespace tpipe

// The tpipe command line as a function, so that a test build can wrap it
// (tests/support/fault_main.cpp installs a fault hook first).
#pragma once

namespace tpipe {

// Parses argv, runs one subcommand, and returns its exit status; on an error
// it prints the message and exits the process itself (2: the user's input is
// wrong; 1: anything else).
int runCommandLine(int argc, char** argv);

// Ends the process with `status` once its output is flushed, without the
// static destructors: LibTorch's unregister every operator, a tenth of a
// short command's time. A sanitizer build ends normally, for its checks.
[[noreturn]] void endProcess(int status);

} // namespace tpipe

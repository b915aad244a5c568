// The tpipe command line as a function, so that a test build can wrap it
// (tests/support/fault_main.cpp installs a fault hook first).
#pragma once

namespace tpipe {

// Parses argv, runs one subcommand, and returns its exit status; on an error
// it prints the message and exits the process itself (2: the user's input is
// wrong; 1: anything else).
int runCommandLine(int argc, char** argv);

} // namespace tpipe

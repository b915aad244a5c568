#include "cli/commands.h"

int main(int argc, char** argv) {
  return tpipe::runCommandLine(argc, argv);
}

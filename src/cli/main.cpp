#include "cli/commands.h"

int main(int argc, char** argv) {
  tpipe::endProcess(tpipe::runCommandLine(argc, argv));
}

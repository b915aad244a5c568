// tpipe's command line with a fault hook:
// TPIPE_FAULT=rank:step:exit|hang|stop|nan[:once-file] makes that rank's
// process die or stop answering at that step, as a crashed or stuck host
// would, or puts a NaN into its input batch, as a bad sample would. With a
// once-file, the fault happens only while that file does not exist (it is
// created then), so a restarted job runs through. Built for the tests only;
// the shipped binary has no such hook.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>

#include "cli/commands.h"
#include "tpipe/trainer.h"

int main(int argc, char** argv) {
  if (const char* fault = std::getenv("TPIPE_FAULT")) {
    int rank = -1;
    long long at = -1;
    char kind[16] = {0};
    char once[4096] = {0};
    if (std::sscanf(fault, "%d:%lld:%15[^:]:%4095s", &rank, &at, kind, once) >=
        3) {
      const std::string what = kind;
      const std::string onceFile = once;
      tpipe::setStepHook([rank, at, what, onceFile](
                             int current, int64_t step, at::Tensor& input) {
        if (current != rank || step != at)
          return;
        if (!onceFile.empty()) {
          if (std::FILE* seen = std::fopen(onceFile.c_str(), "r")) {
            std::fclose(seen);
            return;
          }
          if (std::FILE* mark = std::fopen(onceFile.c_str(), "w"))
            std::fclose(mark);
        }
        std::fprintf(
            stderr,
            "TPIPE_FAULT: rank %d %s at step %lld\n",
            rank,
            what.c_str(),
            at);
        if (what == "nan" && input.is_floating_point()) {
          input = input.clone();
          input.view({-1})[0] = std::numeric_limits<float>::quiet_NaN();
          return;
        }
        if (what == "exit")
          std::_Exit(17);
        if (what == "stop") // the whole process freezes, as under SIGSTOP
          std::raise(SIGSTOP);
        if (what == "hang") {
          for (;;)
            std::this_thread::sleep_for(std::chrono::hours(1));
        }
      });
    }
  }
  tpipe::endProcess(tpipe::runCommandLine(argc, argv));
}

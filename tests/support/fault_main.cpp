// tpipe's command line with a fault hook:
// TPIPE_FAULT=rank:step:exit|hang|stop|nan makes that rank's process die or
// stop answering at that step, as a crashed or stuck host would, or puts a
// NaN into its input batch, as a bad sample would. Built for the tests only;
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
    if (std::sscanf(fault, "%d:%lld:%15s", &rank, &at, kind) == 3) {
      const std::string what = kind;
      tpipe::setStepHook(
          [rank, at, what](int current, int64_t step, at::Tensor& input) {
            if (current != rank || step != at)
              return;
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
  return tpipe::runCommandLine(argc, argv);
}

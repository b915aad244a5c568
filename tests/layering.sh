#!/usr/bin/env bash
# The include floors (docs/architecture.md): a folder includes only headers
# of its own floor or below. Reads every `#include "..."` under src/ and
# include/tpipe/; a header of include/tpipe/ counts as the floor of the
# folder that implements it. Today's known exceptions are listed below:
# an include above its floor that is not listed fails, and so does a listed
# exception that no longer exists (shorten the list as they are fixed).
set -uo pipefail
root=${1:?usage: layering.sh SOURCE_DIR}
cd "$root" || exit 2

# Floors, lowest first.
floor_of() { # a source folder or a header path -> floor number
  case "$1" in
    tpipe/costs.h | tpipe/errors.h | json_input.h | overloaded.h | statistics.h | host_memory.h | default_config.inc) echo 0 ;;
    partitioner | scheduler | scheduler/* | tpipe/partition.h | tpipe/schedule.h) echo 1 ;;
    plan | profiling | tpipe/plan.h | tpipe/tune.h | tpipe/trace.h | tpipe/curves.h) echo 2 ;;
    layers | layers/* | tpipe/layers.h) echo 3 ;;
    runtime | runtime/* | tpipe/pipeline.h | tpipe/distributed.h) echo 4 ;;
    profiler | tpipe/profile.h) echo 5 ;;
    config | model | data | model/* | data/* | tpipe/config.h | tpipe/torchscript.h | tpipe/model.h) echo 6 ;;
    train | train/* | tpipe/trainer.h | tpipe/planning.h | tpipe/tuning.h | tpipe/predict.h) echo 7 ;;
    cli | cli/*) echo 8 ;;
    *) echo "?" ;;
  esac
}
# The floor each public header is implemented on.
header_floor() {
  case "$1" in
    include/tpipe/*) floor_of "tpipe/${1#include/tpipe/}" ;;
    src/*/*) floor_of "$(basename "$(dirname "$1")")" ;;
    src/*) echo 0 ;;
  esac
}

# Known exceptions (issue #32): "file -> included header".
known=()

failed=0 found=()
while IFS= read -r line; do
  file=${line%%:*}
  header=${line#*:}
  from=$(header_floor "$file")
  to=$(floor_of "$header")
  if [[ $from == "?" || $to == "?" ]]; then
    echo "FAILED: $file includes $header, which has no floor in tests/layering.sh"
    failed=1
    continue
  fi
  ((to <= from)) && continue
  found+=("$file -> $header")
  listed=0
  for k in "${known[@]}"; do [[ $k == "$file -> $header" ]] && listed=1; done
  if ((!listed)); then
    echo "FAILED: $file (floor $from) includes $header (floor $to), a floor above it"
    failed=1
  fi
done < <(grep -rHo '#include "[^"]*"' src include/tpipe | sed 's/#include "\(.*\)"/\1/')

for k in "${known[@]}"; do
  present=0
  for f in "${found[@]}"; do [[ $f == "$k" ]] && present=1; done
  if ((!present)); then
    echo "FAILED: the known exception '$k' is gone: remove it from tests/layering.sh"
    failed=1
  fi
done
echo "${#found[@]} include(s) above their floor; ${#known[@]} known exception(s) (issue #32)"
exit $failed

#!/usr/bin/env bash
# Compile-checks the NCCL transport (src/runtime/c10d_transport.cpp with
# TPIPE_USE_NCCL) on a machine without a CUDA LibTorch: this LibTorch's c10d
# headers, the CUDA and NCCL headers at /usr/local/cuda, and the file's own
# compile command (compile_commands.json). Syntax only: nothing is linked or
# run. Skips (77) where those headers are missing.
set -euo pipefail
build="$1"
cuda=/usr/local/cuda/include
[[ -f "$cuda/nccl.h" && -f "$cuda/cuda_runtime_api.h" ]] || {
  echo "SKIP: no CUDA and NCCL headers in $cuda"; exit 77; }
command=$(/usr/bin/python3 - "$build/compile_commands.json" <<'PY'
import json, shlex, sys
source = "src/runtime/c10d_transport.cpp"
for entry in json.load(open(sys.argv[1])):
    # A unity build compiles the file inside a batch: its command, on the file alone.
    batch = "/Unity/" in entry["file"] and source in open(entry["file"]).read()
    if entry["file"].endswith(source) or batch:
        args = shlex.split(entry["command"])
        if batch:
            included = next(line for line in open(entry["file"]) if source in line)
            args = [included.split('"')[1] if a == entry["file"] else a for a in args]
        if "ccache" in args[0]:
            args = args[1:]
        if "-o" in args:
            i = args.index("-o"); del args[i:i + 2]
        print(shlex.join(a for a in args if a not in ("-MD",)))
        break
PY
)
[[ -n "$command" ]] || { echo "no compile command for c10d_transport.cpp"; exit 1; }
if [[ "$command" == *TPIPE_NO_C10D* ]]; then
  echo "SKIP: this build has no c10d"; exit 77
fi
stub=$(mktemp -d)
trap 'rm -rf "$stub"' EXIT
# Debian's CPU LibTorch ships c10's CUDA headers without their generated
# macros file; an empty one stands in (it only configures a shared build).
mkdir -p "$stub/c10/cuda/impl"
echo '#pragma once' > "$stub/c10/cuda/impl/cuda_cmake_macros.h"
cd "$build"
eval "$command -fsyntax-only -DTPIPE_USE_NCCL=1 -idirafter $stub -isystem $cuda"
# The NCCL branch was compiled, not preprocessed away.
# Captured to a file first: piping into a quiet grep under pipefail fails at random when
# grep exits at the match and the preprocessor dies of SIGPIPE.
eval "$command -E -DTPIPE_USE_NCCL=1 -idirafter $stub -isystem $cuda" >"$stub/preprocessed.ii"
grep -q 'ProcessGroupNCCL>' "$stub/preprocessed.ii" \
  || { echo "the NCCL code was not compiled"; exit 1; }
echo "NCCL transport compiles against this LibTorch's c10d and $cuda"

#!/usr/bin/env bash
# tpipe as a user's project meets it: installed into a prefix, found with
# find_package(tpipe) by the examples in examples/, which are built and run;
# then the Debian package, unpacked into a scratch root, runs `tpipe validate`.
set -uo pipefail
build=$(cd "${1:?usage: package.sh BUILD_DIR SOURCE_DIR}" && pwd)
source_dir=${2:?usage: package.sh BUILD_DIR SOURCE_DIR}
work=$(mktemp -d)
trap 'jobs -p | xargs -r kill -9 2>/dev/null; rm -rf "$work"' EXIT
passed=0 failed=0 builds=()
check() {
  if [[ $2 -eq 0 ]]; then echo "ok: $1"; passed=$((passed + 1)); else
    echo "FAILED: $1"; [[ -n ${3:-} ]] && tail -20 "$3" | sed 's/^/    /'; failed=$((failed + 1)); fi
}

cmake --install "$build" --prefix "$work/prefix" >"$work/install.log" 2>&1
check "cmake --install puts the library, headers and package config in a prefix" $? "$work/install.log"
# Installed headers include only installed headers (and their dependencies').
missing=0
for header in "$work"/prefix/include/tpipe/*.h; do
  for included in $(grep -o '#include "tpipe/[a-z_]*\.h"' "$header" | grep -o 'tpipe/[a-z_]*\.h'); do
    [[ -f $work/prefix/include/$included ]] || { echo "    $header includes missing $included"; missing=1; }
  done
  grep -q '#include "runtime/\|#include "train/\|#include "model/' "$header" && { echo "    $header includes a private header"; missing=1; }
done
check "installed headers include nothing that is not installed" $missing

# Each example is one translation unit: the two build side by side.
examples=(custom_module multiprocess)
for example in "${examples[@]}"; do
  (cmake -S "$source_dir/examples/$example" -B "$work/$example" -DCMAKE_PREFIX_PATH="$work/prefix" \
    >"$work/$example.log" 2>&1 && cmake --build "$work/$example" >>"$work/$example.log" 2>&1) &
  builds+=($!)
done
for i in "${!examples[@]}"; do
  wait "${builds[$i]}"
  check "examples/${examples[$i]} builds against the installed package" $? "$work/${examples[$i]}.log"
done
"$work/custom_module/custom_module" >"$work/run1.log" 2>&1
check "examples/custom_module trains (its loss falls)" $? "$work/run1.log"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 RANK=0 "$work/multiprocess/multiprocess" >"$work/r0.log" 2>&1 &
rank0=$!
env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 RANK=1 "$work/multiprocess/multiprocess" >"$work/r1.log" 2>&1
status1=$?
wait "$rank0"
status0=$?
check "examples/multiprocess trains as 2 processes" $((status0 + status1)) "$work/r0.log"

(cd "$work" && cpack -G DEB --config "$build/CPackConfig.cmake" >"$work/cpack.log" 2>&1)
deb=$(ls "$work"/*.deb 2>/dev/null | head -1)
check "cpack -G DEB makes a Debian package" $([[ -n $deb ]]; echo $?) "$work/cpack.log"
if [[ -n $deb ]]; then
  depends=$(dpkg-deb -f "$deb" Depends)
  [[ $depends == *libtorch1.13* ]]
  check "the package depends on Debian's LibTorch runtime" $?
  dpkg -x "$deb" "$work/root"
  "$work/root/usr/bin/tpipe" validate "$work/root/usr/share/tpipe/configs/mlp_synthetic.json" >"$work/validate.log" 2>&1
  check "the unpacked package's tpipe validates an installed config" $? "$work/validate.log"
  [[ -f $work/root/usr/lib/cmake/tpipe/tpipeConfig.cmake || -n $(find "$work/root" -name tpipeConfig.cmake) ]]
  check "the package holds the CMake config" $?
fi
echo "$passed passed, $failed failed"
exit $((failed > 0))

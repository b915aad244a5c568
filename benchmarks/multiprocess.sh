#!/usr/bin/env bash
# Step throughput of the example configs: threads in one process against one
# process per pipeline rank (tpipe launch), side by side in one run; then the
# data-parallel gradient sync overlapped with the backward against after it.
# Usage: benchmarks/multiprocess.sh [OUT.json]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tpipe="${TPIPE_BUILD_DIR:-$root/build}/tpipe"
out="${1:-$root/benchmarks/results/multiprocess.json}"
mkdir -p "$(dirname "$out")"
rate() { sed -n 's/.*done: .* steps in .* s, \([0-9]*\) samples\/s.*/\1/p' | tail -1; }
# Data parallel, 2 replicas x 2 stages: the gradient all-reduce overlapped with
# the backward against after it, alternating, on loopback and (as root, where
# tc is there) on a loopback limited to 1 Gbit/s in a network namespace of its own.
dp_rates() { # OVERLAP -> samples/s
  "$tpipe" launch --nproc 4 "$root/configs/data_parallel_mlp.json" --set "pipeline.overlap_grad_sync=$1" | rate
}
dp_table() { # LINK
  local on=() off=()
  for round in 1 2 3; do
    on+=("$(dp_rates true)")
    off+=("$(dp_rates false)")
  done
  local mean_on mean_off
  mean_on=$(printf '%s\n' "${on[@]}" | awk '{ s += $1 } END { printf "%.0f", s / NR }')
  mean_off=$(printf '%s\n' "${off[@]}" | awk '{ s += $1 } END { printf "%.0f", s / NR }')
  printf '%-20s %14s %14s %8s\n' "dp 2x2 $1" "$mean_off" "$mean_on" \
    "$(awk -v a="$mean_on" -v b="$mean_off" 'BEGIN { printf "%.3f", a / b }')"
  printf ',\n{"config": "data_parallel_mlp", "link": "%s", "after_samples_per_s": %s, "overlapped_samples_per_s": %s, "runs_each": 3}' \
    "$1" "$mean_off" "$mean_on" >> "$out"
}
if [[ ${TPIPE_DP_LINK:-} == limited ]]; then
  ip link set lo up
  if tc qdisc add dev lo root tbf rate 1gbit burst 1mb latency 50ms; then
    dp_table 1gbit
  fi
  exit 0
fi
printf '%-20s %6s %14s %14s %8s\n' config ranks "threads s/s" "processes s/s" ratio
echo '[' > "$out"
first=1
for spec in "mlp_synthetic 2 300" "char_transformer 4 40" "fashion_mnist_cnn 4 120"; do
  set -- $spec
  config="$root/configs/$1.json"
  common=(--set "train.steps=$3" --set train.eval_every=0 --set data.eval_samples=256)
  # The default job tunes itself; across processes it runs the hand-set plan it had.
  [[ $1 == fashion_mnist_cnn ]] && common+=(--set pipeline.auto=false --set pipeline.micro_batches=8 --set pipeline.partition=uniform)
  threads=$("$tpipe" train "$config" "${common[@]}" | rate)
  processes=$("$tpipe" launch --nproc "$2" "$config" "${common[@]}" | rate)
  ratio=$(awk -v a="$processes" -v b="$threads" 'BEGIN { printf "%.2f", a / b }')
  printf '%-20s %6s %14s %14s %8s\n' "$1" "$2" "$threads" "$processes" "$ratio"
  ((first)) || echo ',' >> "$out"
  first=0
  printf '{"config": "%s", "ranks": %s, "threads_samples_per_s": %s, "processes_samples_per_s": %s, "ratio": %s}' \
    "$1" "$2" "$threads" "$processes" "$ratio" >> "$out"
done

printf '\n%-20s %14s %14s %8s\n' "" "after s/s" "overlapped s/s" gain
dp_table loopback
if [[ $(id -u) == 0 ]] && command -v tc >/dev/null && unshare -n true 2>/dev/null; then
  TPIPE_DP_LINK=limited unshare -n "$0" "$out"
fi
echo ']' >> "$out"
echo "wrote $out"

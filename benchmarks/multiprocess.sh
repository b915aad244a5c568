#!/usr/bin/env bash
# Step throughput of the example configs: threads in one process against one
# process per pipeline rank (tpipe launch), side by side in one run.
# Usage: benchmarks/multiprocess.sh [OUT.json]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tpipe="${TPIPE_BUILD_DIR:-$root/build}/tpipe"
out="${1:-$root/benchmarks/results/multiprocess.json}"
mkdir -p "$(dirname "$out")"
rate() { sed -n 's/.*done: .* steps in .* s, \([0-9]*\) samples\/s.*/\1/p' | tail -1; }
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
echo ']' >> "$out"
echo "wrote $out"

#!/usr/bin/env bash
# Step throughput of the example configs: threads in one process against one
# process per pipeline rank (tpipe launch) over Unix sockets and over Gloo,
# side by side in one run, alternating; the dispatch cost per instruction of
# each; then the data-parallel gradient sync overlapped with the backward
# against after it.
# Then steps without a barrier (pipeline.overlap_steps) against steps with one,
# across processes.
# Usage: benchmarks/multiprocess.sh [OUT.json [CONFIG...]] (CONFIG: mlp_synthetic,
# mid_mlp, char_transformer, fashion_mnist_cnn, fashion_2_ranks, dispatch, posted;
# default all, then the data-parallel table)
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
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# A 2-rank job of 2-10 ms steps that no other benchmark uses.
cat > "$scratch/mid_mlp.json" <<'JSON'
{"model": {"input_shape": [256], "layers": [
   {"type": "linear", "out_features": 512}, {"type": "gelu"},
   {"type": "linear", "out_features": 512}, {"type": "gelu"},
   {"type": "linear", "out_features": 512}, {"type": "gelu"},
   {"type": "linear", "out_features": 10}]},
 "data": {"dataset": "synthetic", "samples": 4096},
 "pipeline": {"devices": ["cpu:0", "cpu:1"], "micro_batches": 4, "schedule": "1f1b", "checkpoint": "never"},
 "train": {"batch_size": 128, "steps": 200, "loss": "cross_entropy", "seed": 0,
           "optimizer": {"type": "sgd", "lr": 0.05}}}
JSON
# Dispatch alone: two 1x1 layers, 32 micro-batches of one sample; each rank
# runs 4 instructions per micro-batch (forward, backward, a send, a receive).
cat > "$scratch/dispatch.json" <<'JSON'
{"model": {"input_shape": [1], "layers": [
   {"type": "linear", "out_features": 1}, {"type": "linear", "out_features": 1}]},
 "data": {"dataset": "synthetic", "samples": 1024},
 "pipeline": {"devices": ["cpu:0", "cpu:1"], "micro_batches": 32, "schedule": "1f1b", "checkpoint": "never"},
 "train": {"batch_size": 32, "steps": 300, "loss": "mse", "seed": 0,
           "optimizer": {"type": "sgd", "lr": 0.01}}}
JSON
# Steps without a barrier: a 2-rank job of ~50 ms steps that no other
# benchmark uses.
cat > "$scratch/posted.json" <<'JSON'
{"model": {"input_shape": [768], "layers": [
   {"type": "linear", "out_features": 768}, {"type": "gelu"},
   {"type": "linear", "out_features": 768}, {"type": "gelu"},
   {"type": "linear", "out_features": 768}, {"type": "gelu"},
   {"type": "linear", "out_features": 768}, {"type": "gelu"},
   {"type": "linear", "out_features": 768}, {"type": "gelu"},
   {"type": "linear", "out_features": 768}, {"type": "gelu"}]},
 "data": {"dataset": "synthetic", "samples": 4096},
 "pipeline": {"devices": ["cpu:0", "cpu:1"], "micro_batches": 8, "schedule": "1f1b",
              "checkpoint": "never", "partition": "uniform"},
 "train": {"batch_size": 192, "steps": 60, "loss": "mse", "seed": 0, "eval_every": 0,
           "optimizer": {"type": "sgd", "lr": 0.01}}}
JSON
source "$root/benchmarks/steps.sh" # median, steady_ms
posted_table() {
  printf '\nacross 2 processes: steps with a barrier against steps without one (pipeline.overlap_steps),\n'
  printf '6 x (Linear 768 + GELU), batch 192, 8 micro-batches; medians of %d rounds, alternating\n' "$rounds"
  printf '%-10s %12s %12s %8s\n' schedule "barrier s/s" "posted s/s" gain
  for schedule in 1f1b zb-h1 zb-h2; do
    local barrier=() posted=()
    for ((round = 0; round < rounds; round++)); do
      for overlap in false true; do
        rate=$("$tpipe" launch --nproc 2 "$scratch/posted.json" --set "pipeline.schedule=$schedule" \
          --set "pipeline.overlap_steps=$overlap" | rate)
        if [[ $overlap == true ]]; then posted+=("$rate"); else barrier+=("$rate"); fi
      done
    done
    local b p
    b=$(printf '%s\n' "${barrier[@]}" | median)
    p=$(printf '%s\n' "${posted[@]}" | median)
    printf '%-10s %12s %12s %8s\n' "$schedule" "$b" "$p" "$(awk -v a="$p" -v b="$b" 'BEGIN { printf "%.3f", a / b }')"
    printf ',\n{"config": "posted_across_processes", "schedule": "%s", "barrier_samples_per_s": %s, "posted_samples_per_s": %s, "rounds": %s}' \
      "$schedule" "$b" "$p" "$rounds" >> "$out"
  done
}
rounds=3 oversubscribed_rounds=5
printf 'processes on one host talk over Unix sockets; TPIPE_P2P=gloo is the Gloo path (loopback TCP).\n'
printf 'medians of %d rounds (%d where ranks outnumber cores), contenders alternating; %s cores;\n' \
  "$rounds" "$oversubscribed_rounds" "$(nproc)"
printf '4 ranks on 2 cores are oversubscribed 2x\n'
printf 'samples/s over whole runs (their first steps too); "steady": the threads'"'"' median step over\n'
printf 'the contender'"'"'s in the runs'"'"' second halves, paired by round\n'
printf '%-20s %6s %12s %12s %12s %9s %9s %9s %9s\n' config ranks "threads s/s" "sockets s/s" "gloo s/s" sockets gloo \
  "steady s" "steady g"
echo '[' > "$out"
only=("${@:2}")
echo '{"config": "legend", "what": "samples/s, medians of alternating rounds"}' >> "$out"
for spec in "mlp_synthetic 2 300" "mid_mlp 2 200" "char_transformer 4 40" "fashion_mnist_cnn 4 120" "fashion_2_ranks 2 120" "dispatch 2 300"; do
  set -- $spec
  [[ ${#only[@]} -eq 0 || " ${only[*]} " == *" $1 "* ]] || continue
  config="$root/configs/$1.json"
  [[ -f $config ]] || config="$scratch/$1.json"
  common=(--set "train.steps=$3" --set train.eval_every=0 --set data.eval_samples=256)
  # The default job tunes itself; across processes it runs the hand-set plan it had.
  # On 2 ranks it is not oversubscribed.
  [[ $1 == fashion_* ]] && common+=(--set pipeline.auto=false --set pipeline.micro_batches=8 --set pipeline.partition=uniform)
  if [[ $1 == fashion_2_ranks ]]; then
    config="$root/configs/fashion_mnist_cnn.json"
    common+=(--set 'pipeline.devices=["cpu:0","cpu:1"]')
  fi
  # Oversubscribed ranks wait for a core by the scheduler's whim: the same
  # Fashion pair ran 0.90-1.13 from one round to the next.
  config_rounds=$rounds
  (( $2 > $(nproc) )) && config_rounds=$oversubscribed_rounds
  threads=() sockets=() gloo=() steady_s=() steady_g=()
  for ((round = 0; round < config_rounds; round++)); do
    report() { [[ $1 == dispatch ]] && echo --report "$scratch/$2-$round.json"; true; }
    metrics() { echo --metrics "$scratch/$1-steps"; }
    threads+=("$("$tpipe" train "$config" "${common[@]}" $(report "$1" threads) $(metrics threads) | rate)")
    sockets+=("$("$tpipe" launch --nproc "$2" "$config" "${common[@]}" $(report "$1" sockets) $(metrics sockets) | rate)")
    gloo+=("$(TPIPE_P2P=gloo "$tpipe" launch --nproc "$2" "$config" "${common[@]}" $(report "$1" gloo) $(metrics gloo) | rate)")
    # Steady state, paired within the round: the threads' median step over
    # each contender's (second halves of the runs, as training spends most
    # of its steps).
    t_ms=$(steady_ms "$scratch/threads-steps")
    steady_s+=("$(awk -v a="$t_ms" -v b="$(steady_ms "$scratch/sockets-steps")" 'BEGIN { printf "%.3f", a / b }')")
    steady_g+=("$(awk -v a="$t_ms" -v b="$(steady_ms "$scratch/gloo-steps")" 'BEGIN { printf "%.3f", a / b }')")
  done
  t=$(printf '%s\n' "${threads[@]}" | median)
  s=$(printf '%s\n' "${sockets[@]}" | median)
  g=$(printf '%s\n' "${gloo[@]}" | median)
  ratio_s=$(awk -v a="$s" -v b="$t" 'BEGIN { printf "%.2f", a / b }')
  ratio_g=$(awk -v a="$g" -v b="$t" 'BEGIN { printf "%.2f", a / b }')
  ss=$(printf '%s\n' "${steady_s[@]}" | median)
  sg=$(printf '%s\n' "${steady_g[@]}" | median)
  printf '%-20s %6s %12s %12s %12s %9s %9s %9.2f %9.2f\n' "$1" "$2" "$t" "$s" "$g" "$ratio_s" "$ratio_g" "$ss" "$sg"
  echo ',' >> "$out"
  printf '{"config": "%s", "ranks": %s, "rounds": %s, "threads_samples_per_s": %s, "sockets_samples_per_s": %s, "gloo_samples_per_s": %s, "sockets_vs_threads": %s, "gloo_vs_threads": %s, "steady_sockets_vs_threads": %s, "steady_gloo_vs_threads": %s, "steady_sockets_vs_threads_each_round": [%s], "steady_gloo_vs_threads_each_round": [%s]}' \
    "$1" "$2" "$config_rounds" "$t" "$s" "$g" "$ratio_s" "$ratio_g" "$ss" "$sg" \
    "$(IFS=,; echo "${steady_s[*]}")" "$(IFS=,; echo "${steady_g[*]}")" >> "$out"
  if [[ $1 == dispatch ]]; then
    # From each run's bubble report (its recorded steps): the mean time of a
    # send or receive instruction (4 bytes: nothing but dispatch and the
    # transfer's own cost), of a forward or backward of a 1x1 layer, and the
    # step's wall time over the instructions of a rank; medians of the rounds.
    per() { # CONTENDER FIELD
      for ((round = 0; round < rounds; round++)); do
        /usr/bin/python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
m, instructions = 32, 128  # per rank: m forwards, m backwards, 2m transfers
ranks = r["ranks"]
comm = sum(k["communication_ms"] for k in ranks) / len(ranks)
compute = sum(k["compute_ms"] for k in ranks) / len(ranks)
ms = {"transfer": comm / (2 * m), "compute": compute / (2 * m),
      "wall": r["step_ms"] / instructions}[sys.argv[2]]
print("%.1f" % (ms * 1000))
' "$scratch/$1-$round.json" "$2"
      done | median
    }
    printf '%-20s %6s %12s %12s %12s\n' "  us per transfer" "" "$(per threads transfer)" "$(per sockets transfer)" "$(per gloo transfer)"
    printf '%-20s %6s %12s %12s %12s\n' "  us per fwd/bwd" "" "$(per threads compute)" "$(per sockets compute)" "$(per gloo compute)"
    printf '%-20s %6s %12s %12s %12s\n' "  step / instruction" "" "$(per threads wall)" "$(per sockets wall)" "$(per gloo wall)"
    echo "  (goal per transfer instruction: < 20 us threaded, < 60 us across processes)"
    printf ',\n{"config": "dispatch_us", "transfer": {"threads": %s, "sockets": %s, "gloo": %s}, "forward_or_backward": {"threads": %s, "sockets": %s, "gloo": %s}, "step_per_instruction": {"threads": %s, "sockets": %s, "gloo": %s}}' \
      "$(per threads transfer)" "$(per sockets transfer)" "$(per gloo transfer)" \
      "$(per threads compute)" "$(per sockets compute)" "$(per gloo compute)" \
      "$(per threads wall)" "$(per sockets wall)" "$(per gloo wall)" >> "$out"
  fi
done

if [[ ${#only[@]} -eq 0 || " ${only[*]} " == *" posted "* ]]; then
  posted_table
fi
if [[ ${#only[@]} -gt 0 ]]; then
  echo ']' >> "$out"
  exit 0
fi
printf '\n%-20s %14s %14s %8s\n' "" "after s/s" "overlapped s/s" gain
dp_table loopback
if [[ $(id -u) == 0 ]] && command -v tc >/dev/null && unshare -n true 2>/dev/null; then
  TPIPE_DP_LINK=limited unshare -n "$0" "$out"
fi
echo ']' >> "$out"
echo "wrote $out"

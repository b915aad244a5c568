#!/usr/bin/env bash
# `tpipe tune` and "pipeline": {"auto": true} as a user meets them: the
# table, the JSON, the written config that validates and trains, the auto
# run, and bad input that exits 2 naming the problem.
set -uo pipefail
tpipe=${1:?usage: tune.sh TPIPE_BINARY SOURCE_DIR}
source_dir=${2:?usage: tune.sh TPIPE_BINARY SOURCE_DIR}
config=$source_dir/configs/mlp_synthetic.json
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/support/fork_server.sh"
passed=0 failed=0
ok() { echo "ok: $1"; passed=$((passed + 1)); }
bad() { echo "FAILED: $1"; echo "$2" | sed 's/^/    /' | head -30; failed=$((failed + 1)); }
expect() {
  if [[ $2 == "$5" ]] && grep -qF -- "$3" "$4"; then ok "$1"; else bad "$1 (exit $5, wanted $2 and '$3')" "$(cat "$4")"; fi
}

"$tpipe" tune "$config" --top 3 >"$work/table" 2>"$work/progress"
expect "tune prints a ranked table and the choice" 0 "choice: " "$work/table" $?
expect "tune shows its calibration" 0 "calibration: size curves" "$work/table" 0
expect "tune shows progress on stderr" 0 "tune: profiling" "$work/progress" 0
expect "tune anchors its predictions to the plans it measured in turn" 0 \
  "note: predictions anchored to the" "$work/table" 0
if (($(nproc) >= 2)); then
  # Two-stage runs at several micro-batch counts correct the stage threads'
  # curves at each size: every one of them then predicts what it measured.
  fit=$(sed -n 's/^calibration: two stages at once: measured .* at \([0-9, ]*\) micro-batches;.* within \([0-9.]*\)%$/\1|\2/p' "$work/table")
  if [[ $fit == *,*,*"|"* ]] && python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) <= 5.0 else 1)' "${fit#*|}"; then
    ok "the two-stage calibration runs 3 micro-batch counts and each predicts its own run (${fit#*|}%)"
  else bad "two-stage calibration (got '$fit')" "$(grep '^calibration' "$work/table")"; fi
fi

"$tpipe" tune "$config" --quick --json --write "$work/chosen.json" >"$work/tune.json" 2>/dev/null
status=$?
if [[ $status == 0 ]] && python3 - "$work/tune.json" "$work/chosen.json" <<'PY'
import json, sys
out = json.load(open(sys.argv[1]))
choice = out["choice"]
for key in ["stages", "micro_batches", "schedule", "checkpoint", "virtual_stages",
            "threads_per_stage", "boundaries", "predicted_step_ms", "peak_bytes"]:
    assert key in choice, key
assert out["candidates"], "no candidates"
feasible = [c for c in out["candidates"] if "infeasible" not in c]
times = [c["predicted_step_ms"] for c in feasible]
assert times == sorted(times), "not ranked"
written = json.load(open(sys.argv[2]))["pipeline"]
assert written["micro_batches"] == choice["micro_batches"]
assert written["schedule"] == choice["schedule"]
assert sum(written["balance"]) == 5 and len(written["devices"]) == choice["ranks"]
schedules = {c["schedule"] for c in out["candidates"]}
assert {"dualpipev", "dualpipe"} <= schedules, schedules
PY
then ok "--json lists ranked candidates; --write writes the choice"; else bad "--json / --write" "$(cat "$work/tune.json" | head -30)"; fi

python3 -c '
import json, sys
c = json.load(open(sys.argv[1]))
c["model"] = {"input_shape": [1, 8, 8], "layers": [
    {"type": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1},
    {"type": "batchnorm2d"}, {"type": "relu"}, {"type": "flatten"},
    {"type": "linear", "out_features": 10}]}
json.dump(c, open(sys.argv[2], "w"))' "$config" "$work/normed.json"
"$tpipe" tune "$work/normed.json" --quick --json >"$work/normed_tune.json" 2>/dev/null
status=$?
if [[ $status == 0 ]] && python3 - "$work/normed_tune.json" <<'PY'
import json, sys
schedules = {c["schedule"] for c in json.load(open(sys.argv[1]))["candidates"]}
assert "dualpipev" in schedules and "dualpipe" not in schedules, schedules
PY
then ok "dualpipe, which copies every layer, is not searched for batch norm's running statistics"
else bad "dualpipe with batch norm" "$(head -c 2000 "$work/normed_tune.json")"; fi

"$tpipe" validate "$work/chosen.json" >"$work/validate" 2>&1
expect "the written config validates" 0 "config OK" "$work/validate" $?
"$tpipe" train "$work/chosen.json" --set train.steps=5 >"$work/train" 2>&1
expect "the written config trains" 0 "done: 5 steps" "$work/train" $?

"$tpipe" tune "$config" --measure --top 2 >"$work/measured" 2>/dev/null
status=$?
if [[ $status == 0 ]] && [[ $(grep -cE '^[12] .* [0-9]+\.[0-9]+ +[0-9]+\.[0-9]+ ' "$work/measured") == 2 ]]; then
  ok "--measure prints predicted against measured for the top candidates"
else bad "--measure" "$(cat "$work/measured")"; fi

python3 -c '
import json, sys
c = json.load(open(sys.argv[1]))
c["pipeline"] = {"devices": c["pipeline"]["devices"], "auto": True}
json.dump(c, open(sys.argv[2], "w"))' "$config" "$work/auto.json"
"$tpipe" train "$work/auto.json" --set train.steps=5 >"$work/auto" 2>&1
expect "pipeline.auto tunes, then trains with the choice" 0 "tune: chose" "$work/auto" $?
expect "pipeline.auto trains to the end" 0 "done: 5 steps" "$work/auto" 0

"$tpipe" train "$work/auto.json" --set pipeline.stages=2 >"$work/both" 2>&1
expect "auto next to a hand-picked setting is an error" 2 "pipeline.stages: is chosen by the tuner" "$work/both" $?

echo '{"nodes": 2, "devices_per_node": 4, "device": {"peak_tflops": -1, "memory": "16GiB"}, "intra_node": {"bandwidth_gb_s": 100}}' >"$work/cluster.json"
"$tpipe" tune "$config" --cluster "$work/cluster.json" >"$work/cluster" 2>&1
expect "a bad cluster file names the key" 2 "cluster.device.peak_tflops" "$work/cluster" $?

"$tpipe" tune "$source_dir/configs/gpt3_175b.json" --cluster "$source_dir/configs/cluster_1024.json" --top 3 >"$work/gpt3" 2>&1
expect "--cluster plans GPT-3 on 1024 devices" 0 "x 16 dp" "$work/gpt3" $?

# --write is checked before minutes of tuning: a missing directory and a
# file the tune reads (its --cluster) are refused, the file left as it was.
"$tpipe" tune "$config" --write "$work/nowhere/chosen.json" >"$work/w1" 2>&1
expect "--write into a missing directory is refused" 2 "--write" "$work/w1" $?
if grep -q "tune: profiling" "$work/w1"; then bad "--write is checked before tuning" "$(cat "$work/w1")"; else ok "--write is checked before tuning"; fi
cp "$source_dir/configs/cluster_1024.json" "$work/c.json"
"$tpipe" tune "$source_dir/configs/gpt3_175b.json" --cluster "$work/c.json" --write "$work/c.json" >"$work/w2" 2>&1
expect "--write over the --cluster file is refused" 2 "would replace --cluster" "$work/w2" $?
if cmp -s "$work/c.json" "$source_dir/configs/cluster_1024.json"; then ok "the --cluster file is left as it was"; else bad "--cluster file changed" "$(head -5 "$work/c.json")"; fi

echo "tune: $passed passed, $failed failed"
[[ $failed == 0 ]]

#!/usr/bin/env bash
# Reliability cases, tried the way an unlucky user or a hostile neighbour
# meets them: full disks, damaged checkpoints, signals, kills, probes of the
# rendezvous store, foreign listeners, out-of-range values. Each case prints
# "ok: ..." or "FAILED: ...". Cases that need root (tmpfs mounts) say why
# they are skipped.
set -uo pipefail
tpipe=${1:?usage: reliability.sh TPIPE_BINARY SOURCE_DIR}
source_dir=${2:?usage: reliability.sh TPIPE_BINARY SOURCE_DIR}
config=$source_dir/configs/mlp_synthetic.json
work=$(mktemp -d)
mounted=()
cleanup() {
  jobs -p | xargs -r kill -9 2>/dev/null
  for m in "${mounted[@]}"; do umount "$m" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
source "$(dirname "$0")/support/fork_server.sh"

passed=0 failed=0 skipped=0
ok() { echo "ok: $1"; passed=$((passed + 1)); }
bad() { echo "FAILED: $1"; echo "$2" | sed 's/^/    /' | head -20; failed=$((failed + 1)); }
skip() { echo "skipped: $1"; skipped=$((skipped + 1)); }
# expect NAME STATUS PATTERN LOG: the command exited STATUS and printed PATTERN.
expect() {
  if [[ $2 == "$5" ]] && grep -qF -- "$3" "$4"; then ok "$1"; else bad "$1 (exit $5, wanted $2 and '$3')" "$(cat "$4")"; fi
}
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# Waits (bounded) until FILE has at least N lines.
wait_lines() {
  for _ in $(seq 600); do
    [[ -f $2 && $(wc -l <"$2") -ge $1 ]] && return 0
    sleep 0.1
  done
  return 1
}
long=(--set train.steps=100000 --set train.eval_every=0)

# ---- 0: a command in the fork server's fork is the binary's --------------
# Its output, status, directory and environment, on success and on refusal
# (the same binary twice where no fork server runs).
same=1
for arguments in "validate configs/mlp_synthetic.json" "validate configs/missing.json" \
  "plan configs/mlp_synthetic.json --set pipeline.micro_batches=0" "train configs/mlp_synthetic.json"; do
  (cd "$source_dir" && WORLD_SIZE=2 RANK=5 "$tpipe" $arguments) >"$work/forked.log" 2>&1
  forked=$?
  (cd "$source_dir" && WORLD_SIZE=2 RANK=5 "$tpipe_process" $arguments) >"$work/own.log" 2>&1
  own=$?
  if [[ $forked -ne $own ]] || ! cmp -s "$work/forked.log" "$work/own.log"; then
    same=0
    bad "tpipe $arguments: exit $forked in a fork, $own as its own process" "$(diff "$work/forked.log" "$work/own.log")"
  fi
done
((same)) && ok "commands in the fork server's forks print and exit as the binary does"
expect "and read the environment they were given" 2 "RANK 5 is not below WORLD_SIZE 2" "$work/forked.log" $forked
if [[ $tpipe != "$tpipe_process" ]]; then
  # A signal to the client reaches its fork; a killed client takes its fork along.
  "$tpipe" train "$config" "${long[@]}" --set train.log_every=1 --metrics "$work/fsig.jsonl" >"$work/fsig.log" 2>&1 &
  client=$!
  wait_lines 3 "$work/fsig.jsonl"
  kill -INT $client
  wait $client
  expect "SIGINT to a forked command's client stops the command (exit 130)" 130 "stopped by SIGINT" "$work/fsig.log" $?
  "$tpipe" train "$config" "${long[@]}" --set train.log_every=1 --metrics "$work/fkill.jsonl" >/dev/null 2>&1 &
  client=$!
  wait_lines 3 "$work/fkill.jsonl"
  kill -9 $client
  wait $client 2>/dev/null
  for _ in $(seq 100); do pgrep -P "$fork_server" >/dev/null || break; sleep 0.1; done
  if pgrep -P "$fork_server" >/dev/null; then
    bad "a killed client's fork still runs after 10 s" "$(pgrep -a -P "$fork_server")"
  else
    ok "a killed client's fork ends with it"
  fi
fi

# ---- 1, 2: full disks ---------------------------------------------------
if [[ $(id -u) -eq 0 ]] && mkdir -p "$work/small" && mount -t tmpfs -o size=1M tmpfs "$work/small" 2>/dev/null; then
  mounted+=("$work/small")
  ck=$work/small/ck
  "$tpipe" train "$config" --save "$ck" --stop-after 10 >"$work/disk0.log" 2>&1
  expect "a checkpoint fits on the small disk" 0 "step 10/200" "$work/disk0.log" $?
  # Fill the disk, then leave room for some files of a state but not all.
  for room in 4 40; do
    dd if=/dev/zero of="$work/small/fill" bs=4k 2>/dev/null
    truncate -s -"${room}K" "$work/small/fill"
    "$tpipe" train "$config" --resume "$ck" --save "$ck" --stop-after 11 >"$work/disk.log" 2>&1
    status=$?
    if [[ $status -ne 0 ]] && grep -q "No space left on device (the previous checkpoint is intact)" "$work/disk.log" &&
       python3 -c "import json,sys; d=json.load(open('$ck/checkpoint.json')); sys.exit(d['step'] != 10)"; then
      ok "a full disk while saving ($room KiB free) fails with the reason (exit $status) and keeps step 10"
    else
      bad "a full disk while saving ($room KiB free)" "$(cat "$work/disk.log")"
    fi
    rm -f "$work/small/fill"
    "$tpipe" train "$config" --resume "$ck" --stop-after 12 >"$work/disk2.log" 2>&1
    expect "the last good checkpoint resumes after the full disk ($room KiB)" 0 "resumed at step 10" "$work/disk2.log" $?
  done
else
  skip "full-disk cases: mounting a 1 MiB tmpfs needs root"
fi

# ---- 3: the rendezvous store against probes -----------------------------
p=$(port)
env=(MASTER_ADDR=127.0.0.1 MASTER_PORT=$p WORLD_SIZE=2 TPIPE_JOB_TOKEN=reliability)
env "${env[@]}" RANK=0 "$tpipe_process" train "$config" --set pipeline.timeout_s=20 >"$work/r0.log" 2>&1 &
rank0=$!
python3 - "$p" <<'PY' &
import socket, sys, time
port = int(sys.argv[1])
for _ in range(100):  # the store may not be up yet
    try:
        partial = socket.create_connection(("127.0.0.1", port)); break
    except OSError: time.sleep(0.1)
partial.sendall(b"\x00\x00")                      # half a length prefix, then silence
huge = socket.create_connection(("127.0.0.1", port))
huge.sendall(b"\xff\xff\xff\xff" + b"\x02" * 8)   # announces a 4 GiB message
time.sleep(15)
PY
sleep 1
env "${env[@]}" RANK=1 "$tpipe" train "$config" --set pipeline.timeout_s=20 >"$work/r1.log" 2>&1
s1=$?
wait $rank0
s0=$?
if [[ $s0 -eq 0 && $s1 -eq 0 ]] && grep -q "done: 200 steps" "$work/r0.log"; then
  ok "a half-sent message and a 4 GiB length announcement hold up no rank"
else
  bad "store probes" "$(cat "$work/r0.log" "$work/r1.log")"
fi

p=$(port)
env MASTER_ADDR=127.0.0.1 MASTER_PORT=$p WORLD_SIZE=2 RANK=0 TPIPE_JOB_TOKEN=right \
  "$tpipe_process" train "$config" --set pipeline.timeout_s=4 >"$work/t0.log" 2>&1 &
rank0=$!
env MASTER_ADDR=127.0.0.1 MASTER_PORT=$p WORLD_SIZE=2 RANK=1 TPIPE_JOB_TOKEN=wrong \
  "$tpipe" train "$config" --set pipeline.timeout_s=4 >"$work/t1.log" 2>&1
expect "a rank with another job token is refused" 2 "the job token differs" "$work/t1.log" $?
wait $rank0
expect "and rank 0 names the rank that never joined" 2 "rank(s) 1 of WORLD_SIZE 2 did not join" "$work/t0.log" $?

# ---- 4: a foreign listener on MASTER_PORT --------------------------------
p=$(port)
python3 -c "
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('127.0.0.1', $p)); s.listen(8)
c = s.accept(); time.sleep(60)" &
sleep 0.5
start=$SECONDS
env MASTER_ADDR=127.0.0.1 MASTER_PORT=$p WORLD_SIZE=2 RANK=1 "$tpipe" train "$config" \
  --set pipeline.timeout_s=3 >"$work/foreign.log" 2>&1
status=$?
if [[ $status -eq 2 && $((SECONDS - start)) -le 13 ]] && grep -q "127.0.0.1:$p" "$work/foreign.log" &&
   grep -q "another program" "$work/foreign.log"; then
  ok "a foreign listener on MASTER_PORT is named within the timeout ($((SECONDS - start)) s)"
else
  bad "foreign listener (exit $status after $((SECONDS - start)) s)" "$(cat "$work/foreign.log")"
fi
kill %% 2>/dev/null

# ---- 5: damaged checkpoints -----------------------------------------------
"$tpipe" train "$config" --save "$work/ck5" --stop-after 3 >/dev/null 2>&1
for file in model.pt optimizer.pt; do
  cp -r "$work/ck5" "$work/ck5-$file"
  target=$(ls -d "$work/ck5-$file"/state-*/)$file
  printf '\xde\xad\xbe\xef' | dd of="$target" bs=1 seek=200 conv=notrunc 2>/dev/null
  "$tpipe" train "$config" --resume "$work/ck5-$file" >"$work/dmg.log" 2>&1
  expect "4 flipped bytes in $file are caught on resume" 2 "$file is damaged" "$work/dmg.log" $?
done

# ---- 6, 11: values out of range ------------------------------------------
check_value() {  # check_value SETTING EXPECTED-TEXT
  "$tpipe" validate "$config" --set "$1" >"$work/v.log" 2>&1
  expect "--set $1 is refused" 2 "$2" "$work/v.log" $?
}
check_value pipeline.virtual_stages=4294967296 "pipeline.virtual_stages: expected a positive integer up to 64"
check_value pipeline.data_parallel=4294967296 "pipeline.data_parallel: expected a positive integer up to 65536"
check_value pipeline.micro_batches=4294967297 "pipeline.micro_batches: expected a positive integer up to 65536"
check_value pipeline.threads_per_device=100000 "pipeline.threads_per_device: expected a non-negative integer up to 1024"
for size in nan inf 0.1B 1e30GiB; do
  check_value "pipeline.devices=[{\"name\":\"cpu:0\",\"memory\":\"$size\"},\"cpu:1\"]" "pipeline.devices[0].memory"
done
"$tpipe" schedule --stages 4 --micro-batches 100000000 >"$work/s.log" 2>&1
expect "a schedule of 10^8 micro-batches is refused at once" 2 "--micro-batches" "$work/s.log" $?
"$tpipe" schedule --stages 4 --micro-batches 8 --schedule auto --memory-limit 8,8 >"$work/s.log" 2>&1
expect "auto's memory limits must name every stage" 2 "--memory-limit: 2 limits for 4 stages" "$work/s.log" $?
"$tpipe" schedule --stages 4 --micro-batches 8 --schedule auto --memory-limit 8,x,8,8 >"$work/s.log" 2>&1
expect "auto's memory limits must be counts" 2 "--memory-limit: 'x' is not a micro-batch count" "$work/s.log" $?

# ---- 7: deep nesting -----------------------------------------------------
python3 -c "print('{\"model\": ' + '[' * 70000 + ']' * 70000 + '}')" >"$work/deep.json"
"$tpipe" validate "$work/deep.json" >"$work/deep.log" 2>&1
expect "a value nested 70,000 deep is refused" 2 "nested deeper than 64 levels" "$work/deep.log" $?

# ---- 8, 13: --save checked before the first step; another run's checkpoint --
"$tpipe" train "$config" --save /proc/tpipe-cannot-write >"$work/save.log" 2>&1
status=$?
if [[ $status -eq 2 ]] && grep -q -- "--save /proc/tpipe-cannot-write" "$work/save.log" && ! grep -q "^step " "$work/save.log"; then
  ok "an unwritable --save fails before the first step"
else
  bad "unwritable --save (exit $status)" "$(cat "$work/save.log")"
fi
"$tpipe" train "$config" --save "$work/ck5" --set train.seed=9 --stop-after 2 >"$work/other.log" 2>&1
expect "--save over another run's checkpoint is refused" 2 "of a different run" "$work/other.log" $?
"$tpipe" train "$config" --save "$work/ck5" --set train.seed=9 --stop-after 2 --overwrite >"$work/over.log" 2>&1
expect "--overwrite replaces it" 0 "done: 2 steps" "$work/over.log" $?

# ---- 9: ranks that disagree ----------------------------------------------
for setting in train.seed=5 pipeline.schedule=gpipe; do
  p=$(port)
  env MASTER_ADDR=127.0.0.1 MASTER_PORT=$p WORLD_SIZE=2 RANK=0 "$tpipe_process" train "$config" --set pipeline.timeout_s=10 \
    >"$work/d0.log" 2>&1 &
  rank0=$!
  env MASTER_ADDR=127.0.0.1 MASTER_PORT=$p WORLD_SIZE=2 RANK=1 "$tpipe" train "$config" --set pipeline.timeout_s=10 \
    --set "$setting" >"$work/d1.log" 2>&1
  expect "a rank run with --set $setting is stopped, naming the key" 2 "first at '${setting%%=*}'" "$work/d1.log" $?
  wait $rank0
done

# ---- 10: resume on another layout -----------------------------------------
"$tpipe" train "$config" --save "$work/ck10" --stop-after 4 >/dev/null 2>&1
for devices in '["cpu:0","cpu:1","cpu:2"]' '["cpu:0"]'; do
  cp -r "$work/ck10" "$work/ck10-copy"
  "$tpipe" train "$config" --resume "$work/ck10-copy" --set "pipeline.devices=$devices" --stop-after 6 \
    >"$work/layout.log" 2>&1
  expect "a 2-stage checkpoint resumes on $devices" 0 "random generators are re-seeded" "$work/layout.log" $?
  rm -rf "$work/ck10-copy"
done
"$tpipe" train "$config" --resume "$work/ck10" --set 'train.optimizer={"type":"adam","lr":0.001}' >"$work/adam.log" 2>&1
expect "SGD state into Adam is a clear error" 2 "holds sgd optimizer state" "$work/adam.log" $?

# ---- 12: logs and metrics survive a kill ---------------------------------
"$tpipe_process" train "$config" "${long[@]}" --set train.log_every=1 --metrics "$work/m.jsonl" >"$work/kill.log" 2>&1 &
victim=$!
if wait_lines 40 "$work/m.jsonl"; then
  kill -9 $victim
  wait $victim 2>/dev/null
  if [[ $(wc -l <"$work/m.jsonl") -ge 40 ]] && grep -q "^step 40/" "$work/kill.log"; then
    ok "metrics and progress written before a kill -9 are kept"
  else
    bad "logs after kill" "$(tail -3 "$work/kill.log")"
  fi
else
  kill -9 $victim
  bad "logs after kill: no metrics within 60 s" "$(tail -3 "$work/kill.log")"
fi

# ---- 13: signals -----------------------------------------------------------
for signal in TERM INT; do
  rm -rf "$work/sig" "$work/sig.jsonl"
  "$tpipe_process" train "$config" "${long[@]}" --metrics "$work/sig.jsonl" --save "$work/sig" >"$work/sig.log" 2>&1 &
  victim=$!
  wait_lines 5 "$work/sig.jsonl"
  kill -$signal $victim
  wait $victim
  status=$?
  [[ $signal == TERM ]] && code=143 || code=130
  if [[ $status -eq $code ]] && grep -q "stopped by SIG$signal after step" "$work/sig.log" &&
     "$tpipe" train "$config" --resume "$work/sig" "${long[@]}" --stop-after 1 >/dev/null 2>&1; then
    ok "SIG$signal finishes the step, checkpoints and exits $code"
  else
    bad "SIG$signal (exit $status)" "$(tail -5 "$work/sig.log")"
  fi
done
rm -rf "$work/sig" "$work/lsig.jsonl"
"$tpipe_process" launch --nproc 2 "$config" "${long[@]}" --metrics "$work/lsig.jsonl" --save "$work/sig" >"$work/lsig.log" 2>&1 &
victim=$!
wait_lines 5 "$work/lsig.jsonl"
kill -INT $victim
wait $victim
status=$?
steps=$(grep -o "stopped by SIG[A-Z]* after step [0-9]*" "$work/lsig.log" | grep -o "[0-9]*$" | sort -u)
if [[ $status -ne 0 ]] && [[ $(echo "$steps" | wc -l) -eq 1 && -n $steps ]] &&
   python3 -c "import json,sys; sys.exit(json.load(open('$work/sig/checkpoint.json'))['step'] != $steps)"; then
  ok "under tpipe launch every rank checkpoints the same step ($steps)"
else
  bad "launch SIGINT (exit $status, steps '$steps')" "$(tail -8 "$work/lsig.log")"
fi

# A stop while pipeline.auto tunes ends the run at the tune's next
# measurement, not after the tune.
"$tpipe_process" train "$source_dir/configs/reference_mlp.json" --set train.steps=5 >"$work/tsig.log" 2>&1 &
victim=$!
for _ in $(seq 600); do
  kill -0 $victim 2>/dev/null || break
  grep -qF "tune: profiling" "$work/tsig.log" && break
  sleep 0.1
done
kill -INT $victim
wait $victim
status=$?
if [[ $status -eq 130 ]] && grep -qF "stopped by SIGINT while pipeline.auto tuned" "$work/tsig.log" &&
   ! grep -qF "tune: chose" "$work/tsig.log"; then
  ok "SIGINT while pipeline.auto tunes stops the tune and exits 130"
else
  bad "SIGINT while tuning (exit $status)" "$(tail -5 "$work/tsig.log")"
fi

# ---- 14: exit codes ---------------------------------------------------------
"$tpipe" train "$work/missing.json" >"$work/e.log" 2>&1
expect "a missing config exits 2" 2 "missing.json" "$work/e.log" $?
"$tpipe" frobnicate >"$work/e.log" 2>&1
expect "an unknown subcommand exits 2 with the usage" 2 "Subcommands:" "$work/e.log" $?
"$tpipe" validate "$config" --set pipeline.schedul=1f1b >"$work/e.log" 2>&1
if [[ $(grep -o "schedule," "$work/e.log" | wc -l) -eq 1 ]]; then ok "did-you-mean lists each key once"; else
  bad "did-you-mean duplicates" "$(cat "$work/e.log")"; fi

# ---- 15: batch norm in a scripted model: remat and gpipe ------------------
/usr/bin/python3 - "$work/bn.pt" <<'PY'
import sys, torch, torch.nn as nn
torch.manual_seed(0)
m = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                  nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                  nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
torch.jit.script(m).save(sys.argv[1])
PY
cat >"$work/bn.json" <<JSON
{"model": {"input_shape": [1, 6, 6], "torchscript": "$work/bn.pt"},
 "data": {"dataset": "synthetic", "samples": 64},
 "pipeline": {"devices": ["cpu:0", "cpu:1"], "micro_batches": 4, "schedule": "1f1b"},
 "train": {"batch_size": 16, "steps": 3, "eval_every": 0, "optimizer": {"type": "sgd", "lr": 0.5}}}
JSON
"$tpipe" train "$work/bn.json" --set pipeline.checkpoint=always --save "$work/bn-always" >"$work/bn.log" 2>&1
if /usr/bin/python3 -c "
import sys, torch
d = torch.load('$work/bn-always/model.pt')
counts = [int(v) for k, v in d.items() if k.endswith('num_batches_tracked')]
sys.exit(counts != [12, 12])"; then
  ok "batch norm under checkpoint always counts each of 3 x 4 micro-batches once"
else
  bad "batch norm buffers under remat" "$(cat "$work/bn.log")"
fi
for schedule in gpipe 1f1b; do
  "$tpipe" train "$work/bn.json" --set pipeline.schedule=$schedule --save "$work/bn-$schedule" >"$work/bn-$schedule.log" 2>&1
done
if /usr/bin/python3 -c "
import sys, torch
a = torch.load('$work/bn-gpipe/model.pt'); b = torch.load('$work/bn-1f1b/model.pt')
sys.exit(not all(torch.equal(a[k], b[k]) for k in a))"; then
  ok "gpipe and 1f1b train a batch-norm model bit-identically"
else
  bad "gpipe against 1f1b on batch norm" "$(tail -3 "$work/bn-gpipe.log")"
fi

# ---- 16: one writer per checkpoint directory -----------------------------
"$tpipe_process" train "$config" "${long[@]}" --save "$work/race" --metrics "$work/race1.jsonl" >"$work/race1.log" 2>&1 &
first=$!
"$tpipe_process" train "$config" "${long[@]}" --save "$work/race" --metrics "$work/race2.jsonl" >"$work/race2.log" 2>&1 &
second=$!
refused="" winner=""
for _ in $(seq 600); do
  if ! kill -0 $first 2>/dev/null; then refused=$first winner=$second; break; fi
  if ! kill -0 $second 2>/dev/null; then refused=$second winner=$first; break; fi
  sleep 0.1
done
wait "$refused"
status=$?
log=$work/race1.log; [[ $refused == "$second" ]] && log=$work/race2.log
expect "of two runs started together on one --save directory, one is refused naming the holder" 2 "another run (PID $winner) is writing checkpoints there" "$log" $status
"$tpipe" train "$config" --resume "$work/race" >"$work/race-resume.log" 2>&1
expect "--resume of a directory another run is writing is refused" 2 "another run (PID $winner)" "$work/race-resume.log" $?
winner_metrics=$work/race1.jsonl; [[ $winner == "$second" ]] && winner_metrics=$work/race2.jsonl
wait_lines 3 "$winner_metrics"
kill -TERM "$winner"
wait "$winner"
if [[ -f $work/race/model.pt ]] && "$tpipe" train "$config" --resume "$work/race" --save "$work/race/" "${long[@]}" --stop-after 1 >"$work/race-after.log" 2>&1 &&
   grep -q "resumed at step" "$work/race-after.log"; then
  ok "the winner's checkpoint is whole, and --resume d --save d/ (one directory, spelled twice) resumes it"
else
  bad "after the race" "$(cat "$work/race-after.log")"
fi
"$tpipe_process" train "$config" "${long[@]}" --save "$work/dead" --metrics "$work/dead.jsonl" >/dev/null 2>&1 &
victim=$!
wait_lines 3 "$work/dead.jsonl"
kill -9 $victim
wait $victim 2>/dev/null
"$tpipe" train "$config" --save "$work/dead" --overwrite --stop-after 1 >"$work/dead.log" 2>&1
expect "a killed holder leaves no lock behind" 0 "done: 1 steps" "$work/dead.log" $?

: >"$work/not-a-checkpoint"
"$tpipe" train "$config" --resume "$work/not-a-checkpoint" >"$work/resume-file.log" 2>&1
expect "--resume of a file is named as a file, not a checkpoint directory" 2 "is a file, not a directory" "$work/resume-file.log" $?

# ---- 17: --resume refuses another run's checkpoint -----------------------
"$tpipe" train "$config" --set train.seed=7 --save "$work/seed7" --stop-after 3 >/dev/null 2>&1
"$tpipe" train "$config" --resume "$work/seed7" >"$work/seed.log" 2>&1
expect "a seed-7 checkpoint resumed under seed 0 is refused naming the key" 2 "train.seed was 7, is 0" "$work/seed.log" $?
sed '0,/"relu"/s//"tanh"/' "$config" >"$work/tanh.json"
"$tpipe" train "$work/tanh.json" --set train.seed=7 --resume "$work/seed7" >"$work/tanh.log" 2>&1
expect "relu changed to tanh is refused naming the layer" 2 'model.layers[1].type was "relu", is "tanh"' "$work/tanh.log" $?
"$tpipe" train "$config" --set train.seed=7 --set data.samples=999 --resume "$work/seed7" >"$work/samples.log" 2>&1
expect "another data.samples is refused" 2 "data.samples was 2048, is 999" "$work/samples.log" $?
"$tpipe" train "$config" --set train.seed=7 --set train.optimizer.lr=0.01 --resume "$work/seed7" --resume-changed --stop-after 4 >"$work/lr.log" 2>&1
expect "--resume-changed continues with a new learning rate and says so" 0 "continuing with a changed config: train.optimizer.lr was 0.1, is 0.01" "$work/lr.log" $?
python3 -c "
import json; c = json.load(open('$config')); c['model']['layers'] = c['model']['layers'][2:]
json.dump(c, open('$work/short.json', 'w'))"
"$tpipe" train "$work/short.json" --set train.seed=7 --resume "$work/seed7" --resume-changed >"$work/short.log" 2>&1
expect "a model with fewer layers is named, not left to LibTorch" 2 "only the checkpoint has layer(s) 4" "$work/short.log" $?

# ---- 18: output paths ----------------------------------------------------
touch "$work/real-trace.json"
ln -s "$work/real-trace.json" "$work/link-trace.json"
"$tpipe" train "$config" --stop-after 6 --trace "$work/link-trace.json" >"$work/link.log" 2>&1
status=$?
if [[ $status -eq 0 && -L $work/link-trace.json && -s $work/real-trace.json ]]; then
  ok "--trace through a symlink writes its target and keeps the link"
else
  bad "--trace through a symlink (exit $status)" "$(ls -l "$work"/*trace*; tail -3 "$work/link.log")"
fi
if [[ $(id -u) -eq 0 ]] && mknod "$work/full-node" c 1 7 2>/dev/null; then
  "$tpipe" train "$config" --stop-after 6 --trace "$work/full-node" >"$work/node.log" 2>&1
  status=$?
  if [[ $status -eq 2 && -c $work/full-node ]] && grep -q "No space left on device" "$work/node.log"; then
    ok "--trace to a device node (/dev/full's) streams to it, fails naming ENOSPC (exit 2), and the node stays"
  else
    bad "--trace to a device node (exit $status)" "$(ls -l "$work/full-node"; tail -3 "$work/node.log")"
  fi
else
  skip "--trace to a device node: mknod needs root"
fi
mkfifo "$work/fifo"
for flag in "--trace $work" "--timeline $work/missing/t.svg" "--report $work/fifo" "--metrics $work"; do
  # shellcheck disable=SC2086
  "$tpipe" train "$config" $flag >"$work/out.log" 2>&1
  status=$?
  if [[ $status -eq 2 ]] && grep -q -- "${flag%% *} " "$work/out.log" && ! grep -q "^step " "$work/out.log"; then
    ok "$flag is refused before the first step"
  else
    bad "$flag (exit $status)" "$(cat "$work/out.log")"
  fi
done
# An output never replaces what the run reads, however it is spelled.
cp "$config" "$work/own.json"
ln -s "$work/own.json" "$work/own-link.json"
"$tpipe" train "$work/own.json" --set train.steps=4 --save "$work/own-ck" >"$work/own.log" 2>&1
for flag in "--metrics $work/own-link.json" "--report $work/own-ck/checkpoint.json" "--plot $work/own-ck/model.pt" \
            "--trace $work/own-ck/../own-ck/.tpipe-lock" "--timeline $work/t.svg --trace $work/./t.svg"; do
  before=$(cat "$work/own.json" "$work/own-ck/checkpoint.json" | md5sum)
  # shellcheck disable=SC2086
  "$tpipe" train "$work/own.json" --set train.steps=8 --resume "$work/own-ck" --save "$work/own-ck" $flag >"$work/out.log" 2>&1
  status=$?
  if [[ $status -eq 2 ]] && grep -qE -- "would replace|names the same file" "$work/out.log" && ! grep -q "^step " "$work/out.log" &&
     [[ $(cat "$work/own.json" "$work/own-ck/checkpoint.json" | md5sum) == "$before" ]]; then
    ok "$flag is refused (exit 2): $(grep -oE "would replace [^(]*|names the same file" "$work/out.log")"
  else
    bad "$flag over an input (exit $status)" "$(cat "$work/out.log")"
  fi
done
"$tpipe" train "$work/own.json" --set train.steps=8 --resume "$work/own-ck" --save "$work/own-ck" --metrics "$work/own-ck/metrics.jsonl" >"$work/out.log" 2>&1
expect "metrics kept beside the checkpoint, in its directory, are the user's to write" 0 "resumed at step 4" "$work/out.log" $?
"$tpipe" launch --nproc 2 train "$config" --set train.steps=2 >"$work/launch-train.log" 2>&1
expect "launch --nproc 2 train CONFIG trains, as launch --nproc 2 CONFIG does" 0 "done: 2 steps" "$work/launch-train.log" $?
"$tpipe" launch --nproc 2 "$config" --trace "$work" >"$work/launch-out.log" 2>&1
status=$?
if [[ $status -eq 2 ]] && grep -q "is a directory" "$work/launch-out.log" && ! grep -q "lost rank" "$work/launch-out.log"; then
  ok "under launch, a directory as --trace exits 2 on every rank, no rank called lost"
else
  bad "launch --trace DIR (exit $status)" "$(cat "$work/launch-out.log")"
fi

# ---- 19, 20: memory caps bound planning, validate and training ------------
# Peak RSS of a command in KiB, through getrusage of the children.
peak_rss() {
  python3 -c "
import resource, subprocess, sys
status = subprocess.call(sys.argv[2:], stdout=open(sys.argv[1], 'w'), stderr=subprocess.STDOUT)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, status)" "$@"
}
cat >"$work/wide.json" <<'JSON'
{"model": {"input_shape": [64], "layers": [
   {"type": "linear", "out_features": 65536}, {"type": "relu"},
   {"type": "linear", "out_features": 10}]},
 "data": {"dataset": "synthetic", "samples": 2048},
 "pipeline": {"devices": [{"name": "cpu:0", "memory": "64MiB"}, {"name": "cpu:1", "memory": "64MiB"}],
              "micro_batches": 1, "schedule": "1f1b"},
 "train": {"batch_size": 2048, "steps": 2}}
JSON
for command in plan validate train; do
  read -r rss status < <(peak_rss "$work/wide-$command.log" "$tpipe_process" $command "$work/wide.json")
  if [[ $status -eq 2 && $rss -lt 1048576 ]] && grep -qE "INFEASIBLE|does not fit" "$work/wide-$command.log"; then
    ok "$command with 64 MiB caps refuses a 1.5 GiB-per-step plan (exit 2) within $((rss / 1024)) MiB of RSS"
  else
    bad "$command with caps (exit $status, $((rss / 1024)) MiB RSS)" "$(tail -5 "$work/wide-$command.log")"
  fi
done
read -r rss status < <(peak_rss "$work/host.log" "$tpipe_process" train "$work/wide.json" \
  --set 'pipeline.devices=["cpu:0","cpu:1"]' --set train.batch_size=131072 --set data.samples=131072)
if [[ $status -eq 2 && $rss -lt 2097152 ]] && grep -q "available" "$work/host.log"; then
  ok "without caps, a plan beyond the host's memory is refused naming both ($((rss / 1024)) MiB RSS)"
else
  bad "host memory (exit $status, $((rss / 1024)) MiB RSS)" "$(tail -5 "$work/host.log")"
fi
caps='pipeline.devices=[{"name":"cpu:0","memory":"100KiB"},{"name":"cpu:1","memory":"100KiB"}]'
verdicts=""
for command in plan validate train; do
  "$tpipe" $command "$config" --set "$caps" >"$work/cap-$command.log" 2>&1
  verdicts+="$command:$? "
done
if [[ $verdicts == "plan:2 validate:2 train:2 " ]]; then
  ok "with 100 KiB caps plan, validate and train all refuse ($verdicts)"
else
  bad "100 KiB caps ($verdicts)" "$(cat "$work"/cap-*.log | tail -20)"
fi
# Every "would fit" advice, applied as written, fits.
grep "would fit: pipeline\.[a-z_]*=" "$work/cap-plan.log" | sed 's/.*would fit: //; s/ ([^)]*)//g' >"$work/advice.txt"
applied=0 wrong=""
while IFS= read -r advice; do
  args=(--set "$caps")
  IFS=',' read -ra keys <<<"$advice"
  for key in "${keys[@]}"; do args+=(--set "${key# }"); done
  "$tpipe" plan "$config" "${args[@]}" >"$work/applied.log" 2>&1 || wrong+="[$advice] "
  applied=$((applied + 1))
done <"$work/advice.txt"
if [[ -z $wrong ]]; then
  ok "each of the $applied pieces of advice fits when applied"
else
  bad "advice that does not fit when applied: $wrong" "$(cat "$work/cap-plan.log")"
fi

# ---- 21: labels and data files checked at load ---------------------------
fm=/usr/share/datasets/fashion-mnist
mkdir -p "$work/fm"
for f in train-images-idx3-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do ln -s "$fm/$f" "$work/fm/$f"; done
fashion=$source_dir/configs/fashion_mnist_cnn.json
ln -s "$fm/t10k-labels-idx1-ubyte.gz" "$work/fm/train-labels-idx1-ubyte.gz"
"$tpipe" validate "$fashion" --set data.path="$work/fm" >"$work/labels.log" 2>&1
expect "the test labels swapped in for the training labels are refused" 2 "holds 60000 images but" "$work/labels.log" $?
rm "$work/fm/train-labels-idx1-ubyte.gz"
python3 - "$fm/train-labels-idx1-ubyte.gz" "$work/fm/train-labels-idx1-ubyte.gz" <<'PY'
import gzip, sys
data = bytearray(gzip.open(sys.argv[1]).read())
data[8 + 17] = 200
gzip.open(sys.argv[2], 'wb').write(bytes(data))
PY
"$tpipe" validate "$fashion" --set data.path="$work/fm" >"$work/label200.log" 2>&1
expect "a label of 200 is refused at load" 2 "holds label 200, but the model outputs 10 classes" "$work/label200.log" $?
head -c -4 "$fm/train-labels-idx1-ubyte.gz" >"$work/fm/train-labels-idx1-ubyte.gz"
"$tpipe" validate "$fashion" --set data.path="$work/fm" >"$work/cut.log" 2>&1
expect "a gzip file with its trailer cut is caught" 2 "is damaged" "$work/cut.log" $?
text=$source_dir/configs/char_transformer.json
for path in "$work" /dev/zero "$work/fifo"; do
  what="is not a regular file"
  [[ $path == "$work" ]] && what="is a directory"
  "$tpipe" validate "$text" --set data.path="$path" >"$work/path.log" 2>&1
  expect "data.path $path is named as what it is" 2 "$what" "$work/path.log" $?
done

# ---- 22: a TorchScript module whose forward is not its children ----------
# TorchScript reads a class's source: the script is a file, not stdin.
cat >"$work/notchain.py" <<'PY'
import sys, torch, torch.nn as nn
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)
    def forward(self, x):
        return self.b(self.a(x)) + self.b(torch.relu(self.a(x)))
torch.jit.script(M()).save(sys.argv[1])
PY
/usr/bin/python3 "$work/notchain.py" "$work/notchain.pt"
cat >"$work/notchain.json" <<JSON
{"model": {"input_shape": [4], "torchscript": "$work/notchain.pt"},
 "data": {"dataset": "synthetic", "samples": 64}, "pipeline": {"devices": ["cpu:0"]},
 "train": {"batch_size": 16, "steps": 2}}
JSON
"$tpipe" train "$work/notchain.json" >"$work/notchain.log" 2>&1
expect "a scripted forward that is not its children in order is refused" 2 "is not its children in order" "$work/notchain.log" $?

# ---- 23: a stopped rank ends the job within the timeout and a few s -------
"$tpipe_process" launch --nproc 2 "$config" "${long[@]}" --set pipeline.timeout_s=10 --metrics "$work/stop.jsonl" >"$work/stop.log" 2>&1 &
launcher=$!
wait_lines 5 "$work/stop.jsonl"
children=$(pgrep -P $launcher | tail -1)
start=$SECONDS
kill -STOP "$children"
wait $launcher
status=$?
elapsed=$((SECONDS - start))
if [[ $status -ne 0 && $elapsed -le 25 ]] && ! pgrep -P $launcher >/dev/null; then
  ok "a stopped rank (SIGSTOP) ends the job in $elapsed s with timeout_s 10 (bound 25 s; before the fix, 30 s)"
else
  bad "stopped rank (exit $status after $elapsed s)" "$(tail -5 "$work/stop.log")"
fi
kill -CONT "$children" 2>/dev/null; kill -9 "$children" 2>/dev/null

# ---- 23b: the launcher killed (SIGKILL) leaves no rank behind ----------------
"$tpipe_process" launch --nproc 2 --max-restarts 1 "$config" "${long[@]}" --save "$work/orphans" --metrics "$work/orphans.jsonl" >"$work/orphans.log" 2>&1 &
launcher=$!
wait_lines 3 "$work/orphans.jsonl"
ranks=$(pgrep -P $launcher | tr '\n' ' ')
kill -9 $launcher
wait $launcher 2>/dev/null
left=$ranks
for _ in $(seq 100); do # each rank dies with its parent; bounded: 10 s
  left=$(for pid in $ranks; do kill -0 "$pid" 2>/dev/null && echo "$pid"; done | tr '\n' ' ')
  [[ -z ${left// /} ]] && break
  sleep 0.1
done
if [[ -n ${ranks// /} && -z ${left// /} ]]; then
  ok "launch killed with SIGKILL: its ranks ($ranks) are gone too"
else
  bad "launch SIGKILL left ranks '$left' of '$ranks'" "$(tail -5 "$work/orphans.log")"
  for pid in $left; do kill -9 "$pid" 2>/dev/null; done
fi

# ---- 24: small ones --------------------------------------------------------
p=$(port)
env=(MASTER_ADDR=127.0.0.1 MASTER_PORT=$p WORLD_SIZE=2 TPIPE_JOB_TOKEN=dup)
# The pair trains (its metrics show steps) before the duplicate arrives, so
# the claim is tested against a live job however slow the machine is.
env "${env[@]}" RANK=0 "$tpipe_process" train "$config" "${long[@]}" --set pipeline.timeout_s=20 --metrics "$work/dup.jsonl" >"$work/dup0.log" 2>&1 &
dup0=$!
env "${env[@]}" RANK=1 "$tpipe_process" train "$config" "${long[@]}" --set pipeline.timeout_s=20 >"$work/dup1.log" 2>&1 &
dup1=$!
wait_lines 3 "$work/dup.jsonl"
env "${env[@]}" RANK=1 "$tpipe" train "$config" "${long[@]}" --set pipeline.timeout_s=20 >"$work/dup2.log" 2>&1
dup_status=$?
kill -TERM $dup0 $dup1 2>/dev/null
wait $dup0 $dup1
if [[ $dup_status -eq 2 ]] && grep -q "RANK 1 is taken" "$work/dup2.log"; then
  ok "a second process claiming RANK 1 of a running job is told so (exit 2)"
else
  bad "duplicate RANK" "$(cat "$work"/dup*.log | tail -12)"
fi
"$tpipe" profile "$config" --out "$work/profile.json" >/dev/null 2>&1
python3 - "$work/profile.json" "$work" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
names = json.loads(json.dumps(p)); names['layers'][2]['name'] = '2 Tanh'
huge = json.loads(json.dumps(p)); huge['layers'][0]['forward_ms'] = 1e308
zero = json.loads(json.dumps(p)); zero['micro_batch_size'] = 0
for name, value in (('names', names), ('huge', huge), ('zero', zero)):
    json.dump(value, open(sys.argv[2] + '/profile-' + name + '.json', 'w'))
PY
for variant in "names:names layer 2 '2 Tanh'" "huge:forward_ms: expected a number from 0" "zero:micro_batch_size: expected a positive integer"; do
  "$tpipe" train "$config" --profile "$work/profile-${variant%%:*}.json" >"$work/prof.log" 2>&1
  expect "a profile with ${variant%%:*} is refused" 2 "${variant#*:}" "$work/prof.log" $?
done
"$tpipe" train "$config" --save "$work/ptr" --stop-after 2 >/dev/null 2>&1
for pointer in '"step": -5, "state": "state--5"' '"step": 2, "state": "../ck5/state-3"'; do
  python3 -c "
import json; d = json.load(open('$work/ptr/checkpoint.json')); d.update(json.loads('{$pointer}'))
json.dump(d, open('$work/ptr/checkpoint.json', 'w'))"
  "$tpipe" train "$config" --resume "$work/ptr" >"$work/ptr.log" 2>&1
  expect "checkpoint.json naming {$pointer} is refused" 2 "is damaged" "$work/ptr.log" $?
done
for n in -1 0; do
  "$tpipe" train "$config" --stop-after $n >"$work/stop-after.log" 2>&1
  expect "--stop-after $n is refused" 2 "--stop-after" "$work/stop-after.log" $?
done

# ---- 25: --resume auto, the same command line after any failure ------------
"$tpipe" train "$config" --resume auto >"$work/auto0.log" 2>&1
expect "--resume auto without --save is refused" 2 "--resume auto needs --save DIR" "$work/auto0.log" $?
auto=(--save "$work/auto" --resume auto --metrics "$work/auto.jsonl" --set train.checkpoint_every=10 --set train.steps=60 --set train.eval_every=0)
"$tpipe" train "$config" "${auto[@]}" --stop-after 25 >"$work/auto1.log" 2>&1
expect "--resume auto with an empty --save directory starts fresh" 0 "no checkpoint in $work/auto yet, starting fresh" "$work/auto1.log" $?
# A failure after step 25, whose last checkpoint is step 25: steps 26.. are
# redone, and their first records must not stay twice.
python3 - "$work/auto.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "a") as f:
    for step in (26, 27):
        f.write(json.dumps({"step": step, "loss": 9.0}) + "\n")
PY
"$tpipe" train "$config" "${auto[@]}" >"$work/auto2.log" 2>&1
status=$?
steps=$(python3 -c "
import json, sys
steps = [json.loads(l)['step'] for l in open('$work/auto.jsonl') if '\"loss\"' in l]
print('ok' if steps == list(range(1, 61)) else steps)")
if [[ $status -eq 0 ]] && grep -q "resuming from $work/auto's last checkpoint" "$work/auto2.log" &&
   grep -q "dropped 2 record(s) after step 25" "$work/auto2.log" && [[ $steps == ok ]]; then
  ok "the same command resumes at step 25, and the metrics hold one training record per step, 1..60"
else
  bad "--resume auto after a failure (exit $status, steps $steps)" "$(cat "$work/auto2.log")"
fi

echo "$passed passed, $failed failed, $skipped skipped"
exit $((failed > 0))

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
env "${env[@]}" RANK=0 "$tpipe" train "$config" --set pipeline.timeout_s=20 >"$work/r0.log" 2>&1 &
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
  "$tpipe" train "$config" --set pipeline.timeout_s=4 >"$work/t0.log" 2>&1 &
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
  env MASTER_ADDR=127.0.0.1 MASTER_PORT=$p WORLD_SIZE=2 RANK=0 "$tpipe" train "$config" --set pipeline.timeout_s=10 \
    >"$work/d0.log" 2>&1 &
  env MASTER_ADDR=127.0.0.1 MASTER_PORT=$p WORLD_SIZE=2 RANK=1 "$tpipe" train "$config" --set pipeline.timeout_s=10 \
    --set "$setting" >"$work/d1.log" 2>&1
  expect "a rank run with --set $setting is stopped, naming the key" 2 "first at '${setting%%=*}'" "$work/d1.log" $?
  wait
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
"$tpipe" train "$config" "${long[@]}" --set train.log_every=1 --metrics "$work/m.jsonl" >"$work/kill.log" 2>&1 &
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
  "$tpipe" train "$config" "${long[@]}" --metrics "$work/sig.jsonl" --save "$work/sig" >"$work/sig.log" 2>&1 &
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
"$tpipe" launch --nproc 2 "$config" "${long[@]}" --metrics "$work/lsig.jsonl" --save "$work/sig" >"$work/lsig.log" 2>&1 &
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

# ---- 14: exit codes ---------------------------------------------------------
"$tpipe" train "$work/missing.json" >"$work/e.log" 2>&1
expect "a missing config exits 2" 2 "missing.json" "$work/e.log" $?
"$tpipe" frobnicate >"$work/e.log" 2>&1
expect "an unknown subcommand exits 2 with the usage" 2 "Subcommands:" "$work/e.log" $?
"$tpipe" validate "$config" --set pipeline.schedul=1f1b >"$work/e.log" 2>&1
if [[ $(grep -o "schedule," "$work/e.log" | wc -l) -eq 1 ]]; then ok "did-you-mean lists each key once"; else
  bad "did-you-mean duplicates" "$(cat "$work/e.log")"; fi

echo "$passed passed, $failed failed, $skipped skipped"
exit $((failed > 0))

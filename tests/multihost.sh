#!/usr/bin/env bash
# Two hosts on one machine: network namespaces joined by a veth pair, each
# running ranks with only MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK set.
# Needs root (CI runs as root); skips (exit 77) with the reason otherwise.
set -uo pipefail
tpipe=${1:?usage: multihost.sh TPIPE_BINARY SOURCE_DIR}
source_dir=${2:?usage: multihost.sh TPIPE_BINARY SOURCE_DIR}
config=$source_dir/configs/mlp_synthetic.json

id=$$
a=tpipe-a-$id b=tpipe-b-$id
subnet=10.$((77 + id % 100)).$((id / 100 % 250)).
host_a=${subnet}1 host_b=${subnet}2 unreachable=${subnet}9
work=$(mktemp -d)
cleanup() {
  ip netns pids "$a" 2>/dev/null | xargs -r kill -9 2>/dev/null
  ip netns pids "$b" 2>/dev/null | xargs -r kill -9 2>/dev/null
  ip netns del "$a" 2>/dev/null
  ip netns del "$b" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null || ! ip netns add "$a" 2>/dev/null; then
  echo "SKIPPED: creating network namespaces needs root and iproute2 (run as root, as CI does)"
  exit 77
fi
ip netns add "$b"
ip link add "va$id" netns "$a" type veth peer name "vb$id" netns "$b"
ip -n "$a" addr add "$host_a/24" dev "va$id"
ip -n "$b" addr add "$host_b/24" dev "vb$id"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "va$id" up
ip -n "$b" link set "vb$id" up

failures=0 passed=0
check() {  # check NAME CONDITION-EXIT-STATUS MESSAGE
  if [[ $2 -eq 0 ]]; then
    echo "ok: $1"
    passed=$((passed + 1))
  else
    echo "FAILED: $1: $3"
    failures=$((failures + 1))
  fi
}

losses() { python3 -c 'import json,sys; print(" ".join("%.6f" % json.loads(l)["loss"] for l in open(sys.argv[1]) if "\"loss\"" in l))' "$1"; }

# rank NS RANK WORLD LOG [args...]: one rank on one host, in the background.
rank() {
  local ns=$1 r=$2 world=$3 log=$4
  shift 4
  ip netns exec "$ns" env -u GLOO_SOCKET_IFNAME -u TPIPE_GLOO_INTERFACE MASTER_ADDR="$host_a" MASTER_PORT=29511 \
    WORLD_SIZE="$world" RANK="$r" TPIPE_JOB_TOKEN=multihost-$id "$tpipe" train "$config" "$@" >"$log" 2>&1 &
}

# 1. A 2-rank pipeline across the hosts equals the threaded run.
"$tpipe" train "$config" --metrics "$work/threaded.jsonl" >/dev/null 2>&1
rank "$a" 0 2 "$work/r0.log" --metrics "$work/hosts.jsonl" --set pipeline.timeout_s=30
rank "$b" 1 2 "$work/r1.log" --set pipeline.timeout_s=30
wait
same=1
[[ -s $work/hosts.jsonl && "$(losses "$work/threaded.jsonl")" == "$(losses "$work/hosts.jsonl")" ]] && same=0
check "2 ranks on 2 hosts match the threaded losses" $same "$(tail -n 3 "$work/r0.log" "$work/r1.log")"
grep -q "address $host_b (routes to MASTER_ADDR $host_a)" "$work/r1.log"
check "rank 1 advertises its veth address" $? "$(head -3 "$work/r1.log")"
# Another network namespace is another host: no Unix socket reaches it.
grep -q "transfers over Gloo through host memory to rank(s) 1" "$work/r0.log"
check "ranks on two hosts transfer over Gloo" $? "$(head -3 "$work/r0.log")"

# 2. 2 stages x 2 replicas, each pipeline spanning both hosts.
"$tpipe" train "$config" --metrics "$work/threaded-dp.jsonl" >/dev/null 2>&1
dp=(--set pipeline.data_parallel=2 --set pipeline.timeout_s=30)
rank "$a" 0 4 "$work/d0.log" --metrics "$work/dp.jsonl" "${dp[@]}"
rank "$b" 1 4 "$work/d1.log" "${dp[@]}"
rank "$a" 2 4 "$work/d2.log" "${dp[@]}"
rank "$b" 3 4 "$work/d3.log" "${dp[@]}"
wait
close=1
if [[ -s $work/dp.jsonl ]]; then
  python3 - "$work/threaded-dp.jsonl" "$work/dp.jsonl" <<'PY' && close=0
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(f) if '"loss"' in l] for f in sys.argv[1:3])
sys.exit(0 if a and len(a) == len(b) and all(abs(x - y) <= 1e-5 for x, y in zip(a, b)) else 1)
PY
fi
check "2 stages x 2 replicas across 2 hosts match the threaded losses" $close "$(tail -n 3 "$work"/d*.log)"

# 3. A rank whose store host is unreachable gives up within the timeout, naming it.
start=$SECONDS
ip netns exec "$b" env MASTER_ADDR="$unreachable" MASTER_PORT=29512 WORLD_SIZE=2 RANK=1 \
  "$tpipe" train "$config" --set pipeline.timeout_s=5 >"$work/u.log" 2>&1
status=$?
took=$((SECONDS - start))
ok=1
[[ $status -eq 2 && $took -le 15 ]] && grep -q "rendezvous store at $unreachable:29512" "$work/u.log" && ok=0
check "an unreachable store host is named within the timeout (exit $status after ${took} s)" $ok "$(cat "$work/u.log")"

# 4. Rank 0 alone: the missing peer is named within the timeout.
start=$SECONDS
ip netns exec "$a" env MASTER_ADDR="$host_a" MASTER_PORT=29513 WORLD_SIZE=2 RANK=0 \
  "$tpipe" train "$config" --set pipeline.timeout_s=5 >"$work/m.log" 2>&1
status=$?
took=$((SECONDS - start))
ok=1
[[ $status -eq 2 && $took -le 15 ]] && grep -q "rank(s) 1 of WORLD_SIZE 2 did not join within 5 s" "$work/m.log" && ok=0
check "a peer that never comes is named within the timeout (exit $status after ${took} s)" $ok "$(cat "$work/m.log")"

# 5. The store listens on MASTER_ADDR's address only: not reachable on loopback.
rank "$a" 0 2 "$work/l0.log" --set pipeline.timeout_s=8
alone=$!
# Wait (bounded) until the store answers on its own address, so a refusal on
# loopback means it does not listen there, not that it has not started.
for _ in $(seq 50); do
  ip netns exec "$a" bash -c "exec 3<>/dev/tcp/$host_a/29511" 2>/dev/null && break
  sleep 0.1
done
ip netns exec "$a" bash -c "exec 3<>/dev/tcp/127.0.0.1/29511" 2>/dev/null
refused=$?
kill "$alone" 2>/dev/null # its peer never comes: no need to wait out its timeout
wait
check "the store does not listen on other interfaces" $((refused == 0)) "connected to 127.0.0.1:29511"

# 6. Restarted by an outside policy: each host reruns its command with
# --resume auto (a shell loop here; SLURM's requeue or torchrun's restarts
# alike). Host b's rank is killed mid-run; both ranks start again, resume
# from the last checkpoint and finish with one metrics record per step and
# the losses of an uninterrupted run.
steps=1000
"$tpipe" train "$config" --set train.steps=$steps --metrics "$work/long.jsonl" >/dev/null 2>&1
policy() {  # policy NS RANK LOG [args...]: rerun until it succeeds, 3 tries
  local ns=$1 r=$2 log=$3
  shift 3
  ip netns exec "$ns" env -u GLOO_SOCKET_IFNAME -u TPIPE_GLOO_INTERFACE MASTER_ADDR="$host_a" MASTER_PORT=29514 \
    WORLD_SIZE=2 RANK="$r" TPIPE_JOB_TOKEN=multihost-$id bash -c \
    'for try in 1 2 3; do "$@" && exit 0; echo "policy: attempt $try failed"; done; exit 1' \
    policy "$tpipe" train "$config" --set train.steps=$steps --set train.checkpoint_every=100 \
    --set pipeline.timeout_s=10 --save "$work/ck" --resume auto "$@" >"$log" 2>&1 &
}
policy "$a" 0 "$work/p0.log" --metrics "$work/policy.jsonl"
policy "$b" 1 "$work/p1.log"
for _ in $(seq 600); do  # until step 300 is recorded (bounded: 60 s)
  [[ -f $work/policy.jsonl && $(wc -l <"$work/policy.jsonl") -ge 300 ]] && break
  sleep 0.1
done
ip netns pids "$b" | while read -r pid; do
  [[ $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) == "$tpipe train "* ]] && kill -9 "$pid"
done
wait
resumed=1
[[ $(grep -c "resuming from" "$work/p0.log") -ge 1 && $(grep -c '"samples_per_s"' "$work/policy.jsonl") -eq $steps &&
  "$(losses "$work/long.jsonl")" == "$(losses "$work/policy.jsonl")" ]] && resumed=0
check "a rank killed on one host: both hosts rerun with --resume auto and the job finishes as if uninterrupted" $resumed \
  "$(cat "$work/p0.log" "$work/p1.log" | grep -v "^step" | head -40)"

echo "$passed passed, $failures failed"
exit $((failures > 0))

#!/usr/bin/env bash
# Host memory between steps: tpipe train in fresh processes, alternating
#   glibc: malloc as glibc sets it (a glibc.malloc tunable at its default
#          makes tpipe leave malloc alone; a MALLOC_*_ variable would not do:
#          setting one also stops glibc moving its mmap threshold);
#   heap:  tpipe's heap settings only (TPIPE_HOST_CACHE=0): blocks up to
#          32 MiB from a heap that is never trimmed;
#   cache: the default, the heap settings and the cache of freed blocks of
#          1 MiB and more.
# Per contender: the median step of the runs' second halves (median of the
# rounds), page faults per run and peak RSS (GNU time).
# Usage: benchmarks/host_memory.sh [OUT.json]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tpipe="${TPIPE_BUILD_DIR:-$root/build}/tpipe"
out="${1:-$root/benchmarks/results/host-memory.json}"
mkdir -p "$(dirname "$out")"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# Two stages of convolutions on 112 x 112 images: 51 MiB activations per
# micro-batch, above glibc's largest heap threshold.
cat > "$scratch/large_activations.json" <<'JSON'
{"model": {"input_shape": [3, 112, 112], "layers": [
   {"type": "conv2d", "out_channels": 32, "kernel_size": 3, "padding": 1}, {"type": "relu"},
   {"type": "conv2d", "out_channels": 32, "kernel_size": 3, "padding": 1}, {"type": "relu"},
   {"type": "maxpool2d", "kernel_size": 2},
   {"type": "conv2d", "out_channels": 64, "kernel_size": 3, "padding": 1}, {"type": "relu"},
   {"type": "maxpool2d", "kernel_size": 4},
   {"type": "flatten"}, {"type": "linear", "out_features": 10}]},
 "data": {"dataset": "synthetic", "samples": 512, "eval_samples": 64},
 "pipeline": {"devices": ["cpu:0", "cpu:1"], "micro_batches": 2, "schedule": "1f1b", "checkpoint": "never"},
 "train": {"batch_size": 64, "steps": 6, "loss": "cross_entropy", "seed": 0, "eval_every": 0,
           "optimizer": {"type": "sgd", "lr": 0.01}}}
JSON
# A model no one here wrote: torchvision's ResNet-18, scripted, on 160 x 160
# images (where /usr/bin/python3 has torchvision).
resnet=0
if /usr/bin/python3 - "$scratch/resnet18.pt" <<'PY' 2>/dev/null; then resnet=1; fi
import sys, torch, torch.nn as nn, torchvision
torch.manual_seed(0)
r = torchvision.models.resnet18(num_classes=10)
m = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3,
                  r.layer4, r.avgpool, nn.Flatten(), r.fc)
torch.jit.script(m).save(sys.argv[1])
PY
cat > "$scratch/resnet18.json" <<JSON
{"model": {"input_shape": [3, 160, 160], "torchscript": "$scratch/resnet18.pt"},
 "data": {"dataset": "synthetic", "samples": 256, "eval_samples": 32},
 "pipeline": {"devices": ["cpu:0", "cpu:1"], "micro_batches": 4, "schedule": "1f1b"},
 "train": {"batch_size": 64, "steps": 5, "seed": 0, "loss": "cross_entropy", "eval_every": 0,
           "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9}}}
JSON
# The default job's own choice: one stage, all threads, one micro-batch.
fashion=(--set pipeline.auto=false --set 'pipeline.devices=["cpu:0"]' --set pipeline.micro_batches=1
         --set train.steps=300 --set train.eval_every=0 --set data.eval_samples=256)
rounds=3
source "$root/benchmarks/steps.sh" # median, steady_ms
run() { # CONTENDER JOB
  local env=(env)
  case $1 in
    glibc) env+=(GLIBC_TUNABLES=glibc.malloc.tcache_count=7) ;;
    heap) env+=(TPIPE_HOST_CACHE=0) ;;
  esac
  local args=("$root/configs/fashion_mnist_cnn.json" "${fashion[@]}")
  [[ $2 == large_activations ]] && args=("$scratch/large_activations.json")
  [[ $2 == torchvision_resnet18 ]] && args=("$scratch/resnet18.json")
  "${env[@]}" /usr/bin/time -f '%R %M' -o "$scratch/time" "$tpipe" train "${args[@]}" \
    --metrics "$scratch/steps" > "$scratch/log" 2>&1 || { cat "$scratch/log" >&2; exit 1; }
  read -r faults rss < "$scratch/time"
  echo "$(steady_ms "$scratch/steps") $faults $rss"
}
printf 'host memory between steps: fresh tpipe train processes, contenders alternating, medians of %d rounds\n' "$rounds"
printf '%-20s %-6s %10s %10s %12s %12s\n' job malloc "step ms" "vs glibc" "faults/run" "peak RSS MiB"
echo '[' > "$out"
first=1
jobs=(large_activations fashion_one_stage)
(( resnet )) && jobs+=(torchvision_resnet18)
for job in "${jobs[@]}"; do
  declare -A ms=() faults=() rss=()
  for ((round = 0; round < rounds; round++)); do
    order=(glibc heap cache)
    (( round % 2 )) && order=(cache heap glibc)
    for contender in "${order[@]}"; do
      read -r m f r < <(run "$contender" "$job")
      ms[$contender]+="$m "; faults[$contender]+="$f "; rss[$contender]+="$r "
    done
  done
  glibc_ms=$(tr ' ' '\n' <<< "${ms[glibc]}" | grep . | median)
  for contender in glibc heap cache; do
    m=$(tr ' ' '\n' <<< "${ms[$contender]}" | grep . | median)
    f=$(tr ' ' '\n' <<< "${faults[$contender]}" | grep . | median)
    r=$(tr ' ' '\n' <<< "${rss[$contender]}" | grep . | median)
    ratio=$(awk -v a="$m" -v b="$glibc_ms" 'BEGIN { printf "%.3f", a / b }')
    printf '%-20s %-6s %10.2f %10s %12s %12d\n' "$job" "$contender" "$m" "$ratio" "$f" "$((r / 1024))"
    (( first )) || echo ',' >> "$out"
    first=0
    printf '{"job": "%s", "malloc": "%s", "step_ms": %s, "over_glibc": %s, "page_faults": %s, "peak_rss_kib": %s, "rounds": %d, "step_ms_each_round": [%s]}' \
      "$job" "$contender" "$m" "$ratio" "$f" "$r" "$rounds" "$(echo ${ms[$contender]} | tr ' ' ',')" >> "$out"
  done
  unset ms faults rss
done
echo ']' >> "$out"
echo "wrote $out"

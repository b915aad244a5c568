#!/usr/bin/env bash
# The tensors dataset as a user meets it: data written by Python's
# torch.save, trained by tpipe on 2 stages, step for step equal to a PyTorch
# loop over the same tensors, the same shuffled order and the same initial
# weights (a TorchScript model); resumed mid-epoch bit for bit; tpipe predict
# on the checkpoint equal to PyTorch on its weights; the run's curves drawn
# and rendered; and each kind of bad file refused with exit 2, naming the
# file and the problem.
set -uo pipefail
tpipe=${1:?usage: tensors.sh TPIPE_BINARY}
work=$(mktemp -d)
trap '[[ -n ${KEEP:-} ]] || rm -rf "$work"' EXIT
source "$(dirname "$0")/support/fork_server.sh"
passed=0 failed=0
ok() { echo "ok: $1"; passed=$((passed + 1)); }
bad() { echo "FAILED: $1"; echo "$2" | sed 's/^/    /' | head -20; failed=$((failed + 1)); }

/usr/bin/python3 - "$work" <<'PY'
import sys, torch, torch.nn as nn
w = sys.argv[1]
torch.manual_seed(0)
torch.jit.script(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                               nn.Linear(32, 4))).save(f"{w}/mlp.pt")
g = torch.Generator().manual_seed(1)
x = torch.randn(320, 16, generator=g, dtype=torch.float64)   # doubles: converted on load
y = torch.randint(0, 4, (320,), generator=g)
torch.save({"inputs": x, "targets": y}, f"{w}/train.pt")
torch.save({"inputs": x[:64].float(), "targets": y[:64]}, f"{w}/test.pt")
bad = {
    "nokey": {"inputs": x, "labels": y},   # (a one-key dict is beyond LibTorch's unpickler)
    "intinputs": {"inputs": torch.ones(320, 16, dtype=torch.int64), "targets": y},
    "range": {"inputs": x, "targets": y + 4},
    "counts": {"inputs": x, "targets": y[:300]},
    "shape": {"inputs": torch.randn(320, 15), "targets": y},
    "floattargets": {"inputs": x, "targets": y.float()},
    # Fresh empty tensors have storages of no bytes, which the file holds.
    "nosamples": {"inputs": torch.randn(0, 16), "targets": torch.zeros(0, dtype=torch.int64)},
    "nan": {"inputs": x.clone().index_put_((torch.tensor([217]), torch.tensor([5])), torch.tensor(float("nan"), dtype=torch.float64)), "targets": y},
}
for name, value in bad.items():
    torch.save(value, f"{w}/{name}.pt")
torch.save([x, y], f"{w}/list.pt")
open(f"{w}/empty.pt", "wb").close()
open(f"{w}/text.pt", "w").write("inputs,targets\n1,2\n")
PY

config() { # config DATA_PATH
  cat <<JSON
{"model": {"input_shape": [16], "torchscript": "$work/mlp.pt"},
 "data": {"dataset": "tensors", "path": "$1", "eval_path": "$work/test.pt"},
 "pipeline": {"devices": ["cpu:0", "cpu:1"], "micro_batches": 4, "schedule": "1f1b"},
 "train": {"batch_size": 32, "steps": 25, "seed": 3, "eval_every": 0, "loss": "cross_entropy",
           "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9}}}
JSON
}
config "$work/train.pt" >"$work/run.json"
"$tpipe" train "$work/run.json" --metrics "$work/tpipe.jsonl" >"$work/train.log" 2>&1
status=$?
/usr/bin/python3 - "$work" <<'PY' >"$work/compare.log" 2>&1
import json, sys, torch
w = sys.argv[1]
model = torch.jit.load(f"{w}/mlp.pt")
data = torch.load(f"{w}/train.pt")
x, y = data["inputs"].float(), data["targets"]
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
seed, batch, per_epoch = 3, 32, 320 // 32
ours = []
for step in range(25):
    epoch, offset = step // per_epoch, (step % per_epoch) * batch
    if offset == 0:  # tpipe's order: a permutation per epoch from the seed
        g = torch.Generator().manual_seed(seed * 1000003 + 7919 * (epoch + 1))
        order = torch.randperm(320, generator=g)
    index = order[offset:offset + batch]
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x[index]), y[index])
    loss.backward()
    opt.step()
    ours.append(loss.item())
theirs = [json.loads(l)["loss"] for l in open(f"{w}/tpipe.jsonl") if '"loss"' in l]
worst = max(abs(a - b) for a, b in zip(ours, theirs)) if len(theirs) == 25 else float("inf")
print(f"{len(theirs)} steps, worst |tpipe - pytorch| = {worst:.2e}")
sys.exit(0 if worst <= 1e-5 else 1)
PY
compared=$?
if [[ $status -eq 0 && $compared -eq 0 ]]; then
  ok "25 shuffled steps (2.5 epochs) on 2 stages equal a PyTorch loop step for step ($(cat "$work/compare.log"))"
else
  bad "tensors vs PyTorch (train exit $status)" "$(cat "$work/train.log" "$work/compare.log")"
fi

# Resumed mid-epoch (step 13 of 25), the losses continue bit for bit.
"$tpipe" train "$work/run.json" --save "$work/ck" --stop-after 13 --metrics "$work/first.jsonl" >/dev/null 2>&1
"$tpipe" train "$work/run.json" --resume "$work/ck" --metrics "$work/second.jsonl" >"$work/resume.log" 2>&1
if diff <(grep -h '"loss"' "$work/first.jsonl" "$work/second.jsonl" | /usr/bin/python3 -c 'import sys, json; [print(json.loads(l)["step"], repr(json.loads(l)["loss"])) for l in sys.stdin]') \
        <(grep -h '"loss"' "$work/tpipe.jsonl" | /usr/bin/python3 -c 'import sys, json; [print(json.loads(l)["step"], repr(json.loads(l)["loss"])) for l in sys.stdin]') >"$work/diff.log"; then
  ok "stopped at step 13 and resumed, every loss is bit-identical to the uninterrupted run"
else
  bad "resume mid-epoch" "$(cat "$work/diff.log" "$work/resume.log")"
fi

# Memory, measured from a Python without torch (a child's peak RSS starts
# at its parent's size); the files are written first:
# - rss<n>: one stage, 2 steps, 256 features;
# - ranks<n>: two ranks, a whole epoch (40 steps), 1024 features.
/usr/bin/python3 - "$work" <<'PY'
import json, sys, torch
w = sys.argv[1]
def write(name, n, features, layers, devices, batch, steps):
    g = torch.Generator().manual_seed(0)
    torch.save({"inputs": torch.randn(n, features, generator=g),
                "targets": torch.randint(0, 4, (n,), generator=g)}, f"{w}/{name}{n}.pt")
    json.dump({"model": {"input_shape": [features], "layers": layers},
               "data": {"dataset": "tensors", "path": f"{w}/{name}{n}.pt"},
               "pipeline": {"devices": devices, "micro_batches": len(devices)},
               "train": {"batch_size": batch, "steps": steps, "loss": "cross_entropy",
                         "eval_every": 0}},
              open(f"{w}/{name}{n}.json", "w"))
for n in (1000, 250000):
    write("rss", n, 256, [{"type": "linear", "out_features": 4}], ["cpu:0"], 64, 2)
two = [{"type": "linear", "out_features": 8}, {"type": "relu"},
       {"type": "linear", "out_features": 4}]
for n in (400, 20000):
    write("ranks", n, 1024, two, ["cpu:0", "cpu:1"], n // 40, 40)
PY

# A large file is held once while it loads: the peak RSS grows by less than
# 1.5 times the file's size over a tiny file's run (twice would be 2x; the
# whole-buffer unpickler took 3.3x).
/usr/bin/python3 - "$tpipe_process" "$work" <<'PY' >"$work/rss.log" 2>&1
import os, subprocess, sys
tpipe, w = sys.argv[1], sys.argv[2]
def run(n):
    child = subprocess.Popen([tpipe, "train", f"{w}/rss{n}.json"], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    assert status == 0, f"tpipe exited with {status}"
    return usage.ru_maxrss * 1024, os.path.getsize(f"{w}/rss{n}.pt")
small, _ = run(1000)
big, size = run(250000)
os.remove(f"{w}/rss250000.pt")
print(f"peak RSS grew by {(big - small) / size:.2f}x the file's {size >> 20} MiB")
sys.exit(0 if big - small < 1.5 * size else 1)
PY
if [[ $? -eq 0 ]]; then
  ok "a large tensors file is held once while it loads: $(cat "$work/rss.log")"
else
  bad "large file memory" "$(cat "$work/rss.log")"
fi

# Across processes each rank reads only what its stages use: the file is
# mapped, and rank 1 (the last stage, the targets) never touches the 80 MB
# of inputs that rank 0 (the first stage) reads through a whole epoch. Each
# rank's own peak RSS (wait4), against a tiny file's run.
/usr/bin/python3 - "$tpipe_process" "$work" <<'PY' >"$work/ranks.log" 2>&1
import os, socket, subprocess, sys
tpipe, w = sys.argv[1], sys.argv[2]
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
def run(n):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", TPIPE_JOB_TOKEN="ranks-test")
    ranks = [subprocess.Popen([tpipe, "train", f"{w}/ranks{n}.json"], env=dict(env, RANK=str(r)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) for r in (0, 1)]
    peaks = []
    for rank in ranks:
        _, status, usage = os.wait4(rank.pid, 0)
        assert status == 0, f"a rank exited with {status}"
        peaks.append(usage.ru_maxrss * 1024)
    return peaks
small = run(400)
big = run(20000)
inputs = 20000 * 1024 * 4
grown = [(b - s) / inputs for b, s in zip(big, small)]
print(f"peak RSS grew by {grown[0]:.2f}x (rank 0, the inputs) and {grown[1]:.2f}x (rank 1, the targets) "
      f"the inputs' {inputs >> 20} MiB")
# Rank 1's own growth is allocator and socket-buffer noise, 0.00-0.11x over
# runs here; reading the inputs would add about 0.9x, as rank 0's does.
sys.exit(0 if grown[0] > 0.5 and grown[1] < 0.3 else 1)
PY
if [[ $? -eq 0 ]]; then
  ok "each rank reads only what its stages use: $(cat "$work/ranks.log")"
else
  bad "per-rank reading" "$(cat "$work/ranks.log")"
fi

# tpipe predict on the checkpoint of step 13: the outputs equal the
# PyTorch module's with the checkpoint's weights, on 2 stages, on 1, and on
# 2 processes under tpipe launch.
"$tpipe" predict "$work/run.json" --resume "$work/ck" --input "$work/test.pt" --output "$work/out2.pt" >"$work/predict.log" 2>&1
s2=$?
"$tpipe" predict "$work/run.json" --set 'pipeline.devices=["cpu:0"]' --resume "$work/ck" --input "$work/test.pt" --output "$work/out1.pt" >>"$work/predict.log" 2>&1
s1=$?
# Across processes a checkpoint resumes in the layout that wrote it: train
# under launch, then predict under launch.
"$tpipe" launch --nproc 2 "$work/run.json" --save "$work/ckp" --stop-after 5 >>"$work/predict.log" 2>&1 &&
  "$tpipe" launch --nproc 2 predict "$work/run.json" --resume "$work/ckp" --input "$work/test.pt" --output "$work/outp.pt" >>"$work/predict.log" 2>&1
sp=$?
/usr/bin/python3 - "$work" <<'PY' >"$work/predict-compare.log" 2>&1
import sys, torch
w = sys.argv[1]
def expected(checkpoint):
    model = torch.jit.load(f"{w}/mlp.pt")
    import glob  # one process's checkpoint, or each rank's part of one
    parts = glob.glob(f"{w}/{checkpoint}/model.pt") or glob.glob(f"{w}/{checkpoint}/rank-*/model.pt")
    state = {}
    for part in parts:
        state.update(torch.load(part))
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return model(torch.load(f"{w}/test.pt")["inputs"])
pairs = (("out2", "ck"), ("out1", "ck"), ("outp", "ckp"))
worst = max((torch.load(f"{w}/{out}.pt") - expected(ck)).abs().max().item() for out, ck in pairs)
print(f"worst |tpipe - pytorch| = {worst:.2e} over 64 x 4 outputs")
sys.exit(0 if worst <= 1e-6 else 1)
PY
compared=$?
if [[ $s2 -eq 0 && $s1 -eq 0 && $sp -eq 0 && $compared -eq 0 ]] && grep -q "samples/s; wrote" "$work/predict.log"; then
  ok "predict on 2 stages, 1 stage and 2 processes equals PyTorch on the checkpoint's weights ($(cat "$work/predict-compare.log"))"
else
  bad "predict (exit $s2 / $s1 / $sp)" "$(cat "$work/predict.log" "$work/predict-compare.log")"
fi
# A NaN in one sample's input: its prediction is NaN, said so; the others
# are those of the clean input.
/usr/bin/python3 -c "import sys, torch; x = torch.load(sys.argv[1] + '/test.pt')['inputs'].clone(); x[5, 3] = float('nan'); torch.save(x, sys.argv[1] + '/nan-in.pt')" "$work"
"$tpipe" predict "$work/run.json" --resume "$work/ck" --input "$work/nan-in.pt" --output "$work/nan-out.pt" >"$work/p.log" 2>&1
status=$?
if [[ $status -eq 0 ]] && grep -qF "predict: 1 of 64 predictions hold NaN or an infinity, the first sample 5, whose input does too" "$work/p.log" &&
  /usr/bin/python3 -c "
import sys, torch
w = sys.argv[1]; got = torch.load(w + '/nan-out.pt'); clean = torch.load(w + '/out2.pt')
keep = torch.arange(64) != 5
sys.exit(0 if got[5].isnan().all() and torch.equal(got[keep], clean[keep]) else 1)" "$work"; then
  ok "predict says which prediction a NaN input made NaN; the other 63 equal the clean input's"
else
  bad "predict of a NaN input (exit $status)" "$(cat "$work/p.log")"
fi
"$tpipe" predict "$work/run.json" --resume "$work/ck" --input "$work/shape.pt" --output "$work/o.pt" >"$work/p.log" 2>&1
status=$?
if [[ $status -eq 2 ]] && grep -qF "samples are [15] but model.input_shape is [16]" "$work/p.log" && [[ ! -e $work/o.pt ]]; then
  ok "predict refuses inputs of another shape (exit 2) and writes nothing"
else
  bad "predict with wrong shapes (exit $status)" "$(cat "$work/p.log")"
fi
"$tpipe" predict "$work/run.json" --resume "$work/nowhere" --input "$work/test.pt" --output "$work/o.pt" >"$work/p.log" 2>&1
expect_status=$?
if [[ $expect_status -eq 2 ]] && grep -q "nowhere" "$work/p.log"; then
  ok "predict names a missing checkpoint directory (exit 2)"
else
  bad "predict without a checkpoint (exit $expect_status)" "$(cat "$work/p.log")"
fi
"$tpipe" predict "$work/run.json" --resume "$work/ck" --input "$work/test.pt" --output "$work" >"$work/p.log" 2>&1
expect_status=$?
if [[ $expect_status -eq 2 ]] && grep -q -- "--output" "$work/p.log"; then
  ok "predict refuses a directory as --output before running (exit 2)"
else
  bad "predict to a directory (exit $expect_status)" "$(cat "$work/p.log")"
fi

# --plot draws the run's curves; tpipe plot redraws them from --metrics.
# Rendered in headless Chromium (when installed: scripts/render-svg installs
# it) and checked to show the training loss, eval loss and samples/s lines.
"$tpipe" train "$work/run.json" --set train.eval_every=5 --plot "$work/curves.svg" --metrics "$work/plot.jsonl" >"$work/plot.log" 2>&1
s1=$?
"$tpipe" plot "$work/plot.jsonl" --out "$work/again.svg" --title "again" >>"$work/plot.log" 2>&1
s2=$?
if [[ $s1 -eq 0 && $s2 -eq 0 ]] && grep -q "run.json</text>" "$work/curves.svg" && grep -q ">again</text>" "$work/again.svg" &&
   [[ $(grep -c "<circle" "$work/curves.svg") -ge 10 ]]; then
  ok "--plot and tpipe plot write the curves, titled by the config and by --title"
else
  bad "plot (exit $s1 / $s2)" "$(cat "$work/plot.log")"
fi
# tpipe plot never writes over its metrics, names a file that holds no
# metrics records (a config) instead of drawing an empty picture, and draws
# an empty file (a run not yet at its first step) and a diverged run's
# 1e308 losses (which once crashed it).
cp "$work/plot.jsonl" "$work/kept.jsonl"
"$tpipe" plot "$work/plot.jsonl" --out "$work/plot.jsonl" >"$work/p1.log" 2>&1
s1=$?
"$tpipe" plot "$work/run.json" --out "$work/config.svg" >"$work/p2.log" 2>&1
s2=$?
: >"$work/empty.jsonl"
"$tpipe" plot "$work/empty.jsonl" --out "$work/empty.svg" >"$work/p3.log" 2>&1
s3=$?
printf '{"step": 1, "loss": 1e308}\n{"step": 2, "loss": -1e308}\n' >"$work/diverged.jsonl"
"$tpipe" plot "$work/diverged.jsonl" --out "$work/diverged.svg" >"$work/p4.log" 2>&1
s4=$?
if [[ $s1 -eq 2 ]] && grep -q "would replace the metrics file" "$work/p1.log" && cmp -s "$work/plot.jsonl" "$work/kept.jsonl" &&
   [[ $s2 -eq 2 ]] && grep -q "holds no metrics records" "$work/p2.log" && [[ ! -e $work/config.svg ]] &&
   [[ $s3 -eq 0 ]] && grep -q "no training records yet" "$work/empty.svg" &&
   [[ $s4 -eq 0 ]] && grep -q '<polyline class="loss"' "$work/diverged.svg"; then
  ok "tpipe plot refuses --out over its metrics and a file of no records (exit 2); draws an empty and a diverged run"
else
  bad "tpipe plot's input (exits $s1 $s2 $s3 $s4)" "$(cat "$work/p1.log" "$work/p2.log" "$work/p3.log" "$work/p4.log")"
fi
if command -v chromium >/dev/null; then
  "$(dirname "$0")/../scripts/render-svg" "$work/curves.svg" "$work/curves.png" 900x640 >/dev/null 2>&1
  /usr/bin/python3 - "$work/curves.png" <<'PY' >"$work/render.log" 2>&1
import sys
from PIL import Image
image = Image.open(sys.argv[1]).convert("RGB")
def count(rgb):
    return sum(1 for p in image.getdata() if all(abs(a - b) < 40 for a, b in zip(p, rgb)))
shown = {name: count(rgb) for name, rgb in
         (("loss", (31, 119, 180)), ("eval loss", (255, 127, 14)), ("samples/s", (148, 103, 189)))}
print(shown)
sys.exit(0 if all(n >= 150 for n in shown.values()) else 1)
PY
  if [[ $? -eq 0 ]]; then
    ok "Chromium renders the curves: pixels of each line $(cat "$work/render.log")"
  else
    bad "rendered curves" "$(cat "$work/render.log")"
  fi
else
  echo "skipped: rendering the curves (no chromium; scripts/render-svg installs it)"
fi

# Outputs that would replace the run's own input files are refused, the
# files intact: predict's --output over --input (a hard link to it), and a
# trace over data.path.
cp "$work/test.pt" "$work/in.pt"
ln "$work/in.pt" "$work/in-link.pt"
before=$(cat "$work/in.pt" "$work/train.pt" | md5sum)
"$tpipe" predict "$work/run.json" --resume "$work/ck" --input "$work/in.pt" --output "$work/in-link.pt" >"$work/clobber.log" 2>&1
s1=$?
"$tpipe" train "$work/run.json" --set train.steps=2 --trace "$work/train.pt" >>"$work/clobber.log" 2>&1
s2=$?
if [[ $s1 -eq 2 && $s2 -eq 2 && $(cat "$work/in.pt" "$work/train.pt" | md5sum) == "$before" ]] &&
   grep -qF -- "would replace --input" "$work/clobber.log" && grep -qF -- "would replace data.path" "$work/clobber.log"; then
  ok "--output over --input and --trace over data.path are refused (exit 2), the files intact"
else
  bad "outputs over inputs (exit $s1, $s2)" "$(cat "$work/clobber.log")"
fi

for variant in \
  'nokey:missing key "targets"' \
  'intinputs:"inputs" are Long; a model without an embedding first takes floating-point inputs' \
  'range:"targets" hold class 7, but the model outputs 4 classes' \
  'counts:do not hold the same number of samples' \
  'shape:"inputs" samples are [15] but model.input_shape is [16]' \
  'floattargets:"targets" are Float; cross_entropy takes integer class indices' \
  'nosamples:"inputs" holds no samples' \
  'nan:"inputs" sample 217 holds NaN' \
  'list:holds a GenericList' \
  'empty:is empty (expected a torch.save file)' \
  'text:is not a torch.save file'; do
  name=${variant%%:*}
  config "$work/$name.pt" >"$work/bad.json"
  "$tpipe" train "$work/bad.json" >"$work/bad.log" 2>&1
  status=$?
  if [[ $status -eq 2 ]] && grep -qF -- "data.path: $work/$name.pt" "$work/bad.log" &&
     grep -qF -- "${variant#*:}" "$work/bad.log"; then
    ok "$name.pt is refused (exit 2), naming the file and: ${variant#*:}"
  else
    bad "$name.pt (exit $status, wanted 2 and '${variant#*:}')" "$(cat "$work/bad.log")"
  fi
done

echo "$passed passed, $failed failed"
exit $((failed > 0))

#!/usr/bin/env bash
# The FP8 loss-curve check: FP8 against bf16, same seeds and data, on the standard-library corpus.
#
#   [GPUS=1] [STEPS=300] [PRESET=1b] [LOCAL_BATCH=4] [MICROBATCHES=1] [WARMUP=100] [CONTROL=0]
#   bash benchmarks/fp8_loss_curves.sh [OUT]
#
# 1. trains PRESET for STEPS steps on GPUS GPUs (bf16 compute, fp32 main weights, seq 4096, local
#    batch LOCAL_BATCH x MICROBATCHES, lr 3e-4 after WARMUP steps of warm-up, the same seeds and
#    data) twice: --model.float8 none, then --model.float8 tensorwise (torchao float8 linears,
#    weights all-gathered in FP8); with CONTROL=1 a third time in bf16 with torch's fused AdamW
#    instead of the default kernel: two bf16 runs that differ only in roundings, the comparison's floor;
# 2. writes OUT/fp8_vs_bf16.png (the curves and their relative differences) and OUT/fp8_vs_bf16.md
#    (the table every 20 steps, the final losses as means over the last 10 and the last 50 steps, and versions);
# 3. exits 1 unless the final FP8 loss (last 10 steps) is within 1% of the bf16 one (the issue's target).
#
# The warm-up: from a fresh initialisation, Adam's first steps move every weight by about the learning
# rate whatever its gradient. With 20 steps of warm-up at 8k tokens a step, the loss jumps by several
# nats in steps 3-5 and two runs that differ only in roundings leave those steps on different paths
# (session 9: FP8 and bf16 split by 20 % at step 3 and kept a gap of 1-5 % to step 300), which
# measures the chaos of that start rather than FP8. 100 steps keep the runs on one path. The batch:
# at 8k tokens a step (LOCAL_BATCH=2) two bf16 runs that differ only in AdamW's roundings still end 1.1 %
# apart at 1b (session 11), the size of the target; 16k (4, the tokens a step of the 8B rows) brings that
# floor to 0.2-0.5 %.
# Needs torchao==0.17.0 and matplotlib. Only the final checkpoint of each run is kept, then deleted.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
OUT=${1:-runs/fp8_loss_curves}
STEPS=${STEPS:-300} GPUS=${GPUS:-1} PRESET=${PRESET:-1b}
LOCAL_BATCH=${LOCAL_BATCH:-4} MICROBATCHES=${MICROBATCHES:-1} WARMUP=${WARMUP:-100} CONTROL=${CONTROL:-0}
rm -rf "$OUT" && mkdir -p "$OUT"

$PY -m mfsdp.cli prepare-data stdlib "$OUT/stdlib.tokens"
ARGS=(--nproc-per-node "$GPUS" --model.preset "$PRESET" --data.path "$OUT/stdlib.tokens"
      --data.seq_len 4096 --data.local_batch "$LOCAL_BATCH" --data.microbatches "$MICROBATCHES"
      --parallel.compute_dtype bf16 --train.save_only_model true --train.eval_every 0
      --train.steps "$STEPS" --train.warmup_steps "$WARMUP" --train.lr 3e-4 --train.checkpoint_every 0
      --train.keep_checkpoints 1 --train.sample_tokens 0 --train.progress false)

RUNS=(none tensorwise); [ "$CONTROL" = 1 ] && RUNS+=(control)
for run in "${RUNS[@]}"; do
  EXTRA=(--model.float8 "$run"); [ "$run" = control ] && EXTRA=(--model.float8 none --train.adamw_kernel fused)
  $PY -m mfsdp.cli train "${ARGS[@]}" "${EXTRA[@]}" --train.out_dir "$OUT/$run"
  rm -rf "$OUT/$run/checkpoints"
done

$PY - "$OUT" "$PRESET" "$GPUS" "$WARMUP" "$LOCAL_BATCH" "$MICROBATCHES" <<'EOF'
import json, os, statistics, subprocess, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

out, preset, gpus, warmup, local_batch, microbatches = sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:]
def losses(run):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f"{out}/{run}/metrics.jsonl"))}
bf16, fp8 = losses("none"), losses("tensorwise")
control = losses("control") if os.path.exists(f"{out}/control/metrics.jsonl") else None
steps = sorted(set(bf16) & set(fp8))
def rel(other, window):  # the mean losses over the last `window` steps, and their relative difference
    tail = steps[-window:]
    a, b = statistics.mean(bf16[s] for s in tail), statistics.mean(other[s] for s in tail)
    return a, b, (b - a) / a
final_bf16, final_fp8, rel10 = rel(fp8, 10)
rel50 = rel(fp8, 50)[2]

fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 1))
top.plot(steps, [bf16[s] for s in steps], label="bf16")
top.plot(steps, [fp8[s] for s in steps], label="float8 tensorwise + FP8 all-gather")
bottom.plot(steps, [100 * (fp8[s] - bf16[s]) / bf16[s] for s in steps], label="fp8 vs bf16")
if control:
    top.plot(steps, [control[s] for s in steps], label="bf16, fused AdamW (control)", lw=0.8)
    bottom.plot(steps, [100 * (control[s] - bf16[s]) / bf16[s] for s in steps], label="control vs bf16", lw=0.8)
    bottom.legend(fontsize=8)
top.set_ylabel("loss"); top.legend()
top.set_title(f"mfsdp train, {preset} preset, {gpus} GPU(s), {warmup} warm-up steps")
bottom.axhline(0, color="grey", lw=0.5)
bottom.set_ylabel("vs bf16 (%)"); bottom.set_xlabel("step")
fig.tight_layout(); fig.savefig(f"{out}/fp8_vs_bf16.png", dpi=120)

try:
    import torchao
    ao = torchao.__version__
except ImportError:
    ao = None
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
def row(s):
    cells = f"| {s} | {bf16[s]:.4f} | {fp8[s]:.4f} | {100 * (fp8[s] - bf16[s]) / bf16[s]:+.2f} |"
    return cells + (f" {control[s]:.4f} | {100 * (control[s] - bf16[s]) / bf16[s]:+.2f} |" if control else "")
header = "| step | bf16 | fp8 | fp8 vs bf16 % |" + (" control | control vs bf16 % |" if control else "")
rule = "|" + " --- |" * (header.count("|") - 1)
rows = "\n".join(row(s) for s in steps if s % 20 == 0 or s == steps[-1])
floor = ""
if control:
    floor = (f"- the floor, bf16 with torch's fused AdamW against bf16 with the default kernel: "
             f"{100 * rel(control, 10)[2]:+.2f}% over the last 10 steps, {100 * rel(control, 50)[2]:+.2f}% over the last 50\n")
text = (f"# FP8 vs bf16 loss, {preset} preset, {len(steps)} steps, {gpus} GPU(s)\n\n"
        f"- versions: {gpu}, torch {torch.__version__}, torchao {ao}, mfsdp commit {commit}\n"
        f"- shape: seq 4096 x local batch {local_batch} x {microbatches} microbatches per GPU, lr 3e-4, "
        f"{warmup} warm-up steps, the same seeds and data\n"
        f"- final loss (mean of steps {steps[-10]}-{steps[-1]}): bf16 {final_bf16:.4f}, fp8 {final_fp8:.4f}, "
        f"difference {100 * rel10:+.2f}% (target: within 1%); over the last 50 steps {100 * rel50:+.2f}%\n"
        f"{floor}\n{header}\n{rule}\n{rows}\n\n![curves](fp8_vs_bf16.png)\n")
open(f"{out}/fp8_vs_bf16.md", "w").write(text)
print(text)
sys.exit(0 if abs(rel10) <= 0.01 else 1)
EOF

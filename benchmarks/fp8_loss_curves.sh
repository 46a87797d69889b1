#!/usr/bin/env bash
# The FP8 loss-curve check: FP8 against bf16, same seeds and data, on the standard-library corpus.
#
#   [GPUS=1] [STEPS=300] [PRESET=1b] [LOCAL_BATCH=2] [MICROBATCHES=1] bash benchmarks/fp8_loss_curves.sh [OUT]
#
# 1. trains PRESET for STEPS steps on GPUS GPUs (bf16 compute, fp32 main weights, seq 4096, local
#    batch LOCAL_BATCH x MICROBATCHES, the same seeds and data) twice: --model.float8 none, then
#    --model.float8 tensorwise
#    (torchao float8 linears, weights all-gathered in FP8, one gather per block);
# 2. writes OUT/fp8_vs_bf16.png (both curves and their relative difference) and OUT/fp8_vs_bf16.md
#    (the table every 20 steps, the final losses as a mean over the last 10 steps, and versions);
# 3. exits 1 unless the final FP8 loss is within 1% of the bf16 one (the issue's target).
# Needs torchao==0.17.0 and matplotlib. Only the final checkpoint of each run is kept, then deleted.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
OUT=${1:-runs/fp8_loss_curves}
STEPS=${STEPS:-300} GPUS=${GPUS:-1} PRESET=${PRESET:-1b}
LOCAL_BATCH=${LOCAL_BATCH:-2} MICROBATCHES=${MICROBATCHES:-1}
rm -rf "$OUT" && mkdir -p "$OUT"

$PY -m mfsdp.cli prepare-data stdlib "$OUT/stdlib.tokens"
ARGS=(--nproc-per-node "$GPUS" --model.preset "$PRESET" --data.path "$OUT/stdlib.tokens"
      --data.seq_len 4096 --data.local_batch "$LOCAL_BATCH" --data.microbatches "$MICROBATCHES"
      --parallel.compute_dtype bf16 --train.save_only_model true --train.eval_every 0
      --train.steps "$STEPS" --train.warmup_steps 20 --train.lr 3e-4 --train.checkpoint_every 0
      --train.keep_checkpoints 1 --train.sample_tokens 0 --train.progress false)

for float8 in none tensorwise; do
  $PY -m mfsdp.cli train "${ARGS[@]}" --model.float8 "$float8" --train.out_dir "$OUT/$float8"
  rm -rf "$OUT/$float8/checkpoints"
done

$PY - "$OUT" "$PRESET" "$GPUS" <<'EOF'
import json, statistics, subprocess, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

out, preset, gpus = sys.argv[1], sys.argv[2], int(sys.argv[3])
def losses(run):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f"{out}/{run}/metrics.jsonl"))}
bf16, fp8 = losses("none"), losses("tensorwise")
steps = sorted(set(bf16) & set(fp8))
tail = steps[-10:]
final_bf16, final_fp8 = statistics.mean(bf16[s] for s in tail), statistics.mean(fp8[s] for s in tail)
rel = (final_fp8 - final_bf16) / final_bf16

fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 1))
top.plot(steps, [bf16[s] for s in steps], label="bf16")
top.plot(steps, [fp8[s] for s in steps], label="float8 tensorwise + FP8 all-gather")
top.set_ylabel("loss"); top.legend(); top.set_title(f"mfsdp train, {preset} preset, {gpus} GPU(s)")
bottom.plot(steps, [100 * (fp8[s] - bf16[s]) / bf16[s] for s in steps])
bottom.axhline(0, color="grey", lw=0.5)
bottom.set_ylabel("fp8 vs bf16 (%)"); bottom.set_xlabel("step")
fig.tight_layout(); fig.savefig(f"{out}/fp8_vs_bf16.png", dpi=120)

try:
    import torchao
    ao = torchao.__version__
except ImportError:
    ao = None
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
rows = "\n".join(f"| {s} | {bf16[s]:.4f} | {fp8[s]:.4f} | {100 * (fp8[s] - bf16[s]) / bf16[s]:+.2f} |"
                 for s in steps if s % 20 == 0 or s == steps[-1])
text = (f"# FP8 vs bf16 loss, {preset} preset, {len(steps)} steps, {gpus} GPU(s)\n\n"
        f"- versions: {gpu}, torch {torch.__version__}, torchao {ao}, mfsdp commit {commit}\n"
        f"- final loss (mean of steps {tail[0]}-{tail[-1]}): bf16 {final_bf16:.4f}, fp8 {final_fp8:.4f}, "
        f"difference {100 * rel:+.2f}% (target: within 1%)\n\n"
        f"| step | bf16 | fp8 | fp8 vs bf16 % |\n| --- | --- | --- | --- |\n{rows}\n\n![curves](fp8_vs_bf16.png)\n")
open(f"{out}/fp8_vs_bf16.md", "w").write(text)
print(text)
sys.exit(0 if abs(rel) <= 0.01 else 1)
EOF

#!/usr/bin/env bash
# Issue 13's closing note: a 2-GPU 1b resume with identical losses, in deterministic mode.
#
#   bash benchmarks/results/deterministic_resume.sh [OUT]      # from anywhere; default OUT below
#   CONTRAST=1 bash benchmarks/results/deterministic_resume.sh  # also two runs without the mode
#
# 1. trains the 1b preset for 8 steps on 2 GPUs (bf16, seq 4096, local batch 2, a checkpoint at
#    step 4) with --parallel.deterministic true;
# 2. moves that run's step_4 checkpoint into a fresh directory: the run as if stopped at step 4;
# 3. resumes it with --resume to step 8;
# 4. prints both runs' loss and gradient norm side by side and exits 1 unless steps 5-8 are equal.
# With CONTRAST=1 it first runs the same 8 steps twice without the mode (no checkpoints) and prints
# those two side by side: on H200s they differ from step 2 on.
# A 1b checkpoint is about 18 GB (fp32 main weights and Adam moments); the script keeps at most
# two at a time.
set -euo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu_env.sh
OUT=${1:-runs/deterministic_resume}
rm -rf "$OUT" && mkdir -p "$OUT"

$PY -m mfsdp.cli prepare-data stdlib "$OUT/stdlib.tokens"
ARGS=(--nproc-per-node 2 --model.preset 1b --data.path "$OUT/stdlib.tokens"
      --data.seq_len 4096 --data.local_batch 2 --parallel.compute_dtype bf16
      --train.steps 8 --train.warmup_steps 2 --train.lr 3e-4 --train.checkpoint_every 4
      --train.sample_tokens 0 --train.progress false)

side_by_side() {  # side_by_side LEFT_DIR RIGHT_DIR FIRST_STEP: exit 1 unless equal from FIRST_STEP
  $PY - "$@" <<'EOF'
import json, sys
left, right, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
def read(d):
    rows = (json.loads(line) for line in open(f"{d}/metrics.jsonl"))
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows}
a, b = read(left), read(right)
print(f"{'step':>4}  {'loss ' + left:>34}  {'loss ' + right:>34}  grad_norm left / right")
same = True
for step in sorted(set(a) | set(b)):
    (la, ga), (lb, gb) = a.get(step, (None, None)), b.get(step, (None, None))
    equal = step < first or (la == lb and ga == gb)
    same &= equal
    print(f"{step:>4}  {la!r:>34}  {lb!r:>34}  {ga!r} / {gb!r}"
          f"{'' if step < first else ('  identical' if equal else '  DIFFERENT')}")
sys.exit(0 if same else 1)
EOF
}

if [ "${CONTRAST:-0}" = 1 ]; then
  for run in plain_a plain_b; do
    $PY -m mfsdp.cli train "${ARGS[@]}" --train.checkpoint_every 0 --train.keep_checkpoints 1 \
      --train.out_dir "$OUT/$run"
    rm -rf "$OUT/$run/checkpoints"
  done
  echo "== without --parallel.deterministic: two uninterrupted runs"
  side_by_side "$OUT/plain_a" "$OUT/plain_b" 1 || true
fi

$PY -m mfsdp.cli train "${ARGS[@]}" --parallel.deterministic true --train.out_dir "$OUT/uninterrupted"
mkdir -p "$OUT/resumed/checkpoints"
mv "$OUT/uninterrupted/checkpoints/step_4" "$OUT/resumed/checkpoints/step_4"
echo step_4 > "$OUT/resumed/checkpoints/latest"
rm -rf "$OUT/uninterrupted/checkpoints"
$PY -m mfsdp.cli train "${ARGS[@]}" --parallel.deterministic true --train.out_dir "$OUT/resumed" --resume
echo "== --parallel.deterministic true: uninterrupted run vs. resumed from step 4"
side_by_side "$OUT/uninterrupted" "$OUT/resumed" 5

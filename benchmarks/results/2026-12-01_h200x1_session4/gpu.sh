#!/usr/bin/env bash
# The sections of benchmarks/gpu_verify.sh that measured this directory's results: calls 1-3 (`fp8_ab offload16k`, `ab22` with `.carry/base` at 89acf2b, `adamw_floor`).
# Moved here from gpu_verify.sh as its last version had them; they run with its helpers and settings
# (bench, summarize_train, train_row, profiled_row; the NCCL variables of gpu_env.sh):
#
#   bash benchmarks/results/2026-12-01_h200x1_session4/gpu.sh SECTION...    # SECTION: fp8_ab offload16k ab22 adamw_floor
#
# A record of what ran: a later tree may have renamed the flags they pass.
source "$(dirname "${BASH_SOURCE[0]}")/../../gpu_verify.sh"

section_fp8_ab() {  # the 1b FP8 row at HEAD beside .carry/base (a worktree of an earlier tree), one job
  local rows="--preset 1b --local-batch 2 --seq 4096 --compile --steps 8 --warmup 3 --float8 tensorwise --fp8-all-gather"
  IMPL_TIMEOUT=100 bench "$ROOT" mfsdp $rows
  IMPL_TIMEOUT=100 bench "$ROOT/.carry/base" mfsdp $rows
  grep -h '^| mfsdp ' "$OUT/bench.log"
}

section_offload16k() {  # issue 21 at 16k tokens per step (1 x 4096 x 4), no AC, compiled: what fits without
  # offload, and small offload fractions (the CPU step shrinks with the fraction; the freed memory still pays
  # for dropping AC). Each row is skipped when too little of the call's 600 s is left.
  local C="--preset 8b --seq 4096 --local-batch 1 --compile --grad-reduce-dtype bf16 --microbatches 4 --warmup 2 --steps 4"
  for row in "mfsdp" ${OFFLOAD_FS:-0.12 0.18}; do
    local left=$((585 - SECONDS))
    if [ $left -lt 150 ]; then echo "offload16k $row: skipped, ${left} s left"; continue; fi
    if [ "$row" = mfsdp ]; then IMPL_TIMEOUT=130 bench "$ROOT" mfsdp $C
    else IMPL_TIMEOUT=130 bench "$ROOT" mfsdp-offload $C --offload "$row" --offload-threads 14; fi
  done
  grep -h '^| mfsdp' "$OUT/bench.log"
}

section_ab22() {  # ONE GPU, <= 9 min: the GPU suite, then the compiled 1b bf16 rows of HEAD beside .carry/base (the
  # tree before the runtime redesign, 89acf2b) in one job, HEAD first and last (issue 22: within 2 %)
  timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  local rows="--preset 1b --local-batch 2 --seq 4096 --compile --steps 8 --warmup 3"
  IMPL_TIMEOUT=90 bench "$ROOT" mfsdp,fsdp2 $rows
  IMPL_TIMEOUT=90 bench "$ROOT/.carry/base" mfsdp $rows
  [ $SECONDS -lt 500 ] && IMPL_TIMEOUT=90 bench "$ROOT" mfsdp $rows
  grep -h '^| \(mfsdp\|fsdp2\) ' "$OUT/bench.log"
}

section_adamw_floor() {  # ONE GPU, <= 5 min: how far torch's own exact AdamW kernels drift apart. `mfsdp train`
  # 1b, 20 steps, deterministic: fused CUDA AdamW (auto) twice, foreach CUDA AdamW, and half the units on
  # the host (fused CPU AdamW); the losses of each against the first run (issue 21's 1e-5 target).
  local t0=$SECONDS
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local A=(--nproc-per-node 1 --model.preset 1b --data.local_batch 2 --data.seq_len 4096 --data.path /tmp/stdlib.tokens
    --train.steps 20 --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false --train.eval_every 0
    --parallel.deterministic true)
  local -A RUNS=([fused]="" [fused_again]="" [foreach]="--train.adamw_kernel foreach"
    [offload]="--parallel.offload optimizer --parallel.offload_fraction 0.5")
  for run in fused fused_again foreach offload; do
    rm -rf /tmp/floor_$run
    timeout 100 python3 -m mfsdp.cli train "${A[@]}" ${RUNS[$run]} --train.out_dir /tmp/floor_$run \
      > "$OUT/floor_$run.log" 2>&1; echo "train 1b $run rc=$?"
    cp /tmp/floor_$run/metrics.jsonl "$OUT/floor_${run}_metrics.jsonl" 2>/dev/null; rm -rf /tmp/floor_$run
  done
  python3 - "$OUT" <<'PYEOF'
import json, os, sys
loss = {}
for run in ("fused", "fused_again", "foreach", "offload"):
    path = f"{sys.argv[1]}/floor_{run}_metrics.jsonl"
    if os.path.exists(path):
        loss[run] = {r["step"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r}
for run in ("fused_again", "foreach", "offload"):
    if run in loss and "fused" in loss:
        rel = [abs(loss[run][s] - loss["fused"][s]) / abs(loss["fused"][s]) for s in sorted(loss["fused"]) if s in loss[run]]
        print(f"RESULT {run} against fused: {len(rel)} steps, max rel loss diff {max(rel):.2e}, at step 5 "
              f"{rel[4]:.2e}, last {rel[-1]:.2e}")
PYEOF
  echo "adamw_floor: $((SECONDS - t0)) s"
}

gpu_verify_main "$@"

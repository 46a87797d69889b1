#!/usr/bin/env bash
# The sections of benchmarks/gpu_verify.sh that measured this directory's results: calls 1 and 2 (`keep10`, `curves8b`).
# Moved here from gpu_verify.sh as its last version had them; they run with its helpers and settings
# (bench, summarize_train, train_row, profiled_row; the NCCL variables of gpu_env.sh):
#
#   bash benchmarks/results/2026-12-03_h200x1_session10/gpu.sh SECTION...    # SECTION: keep10 curves8b
#
# A record of what ran: a later tree may have renamed the flags they pass.
source "$(dirname "${BASH_SOURCE[0]}")/../../gpu_verify.sh"

section_keep10() {  # ONE GPU, <= 9.5 min: issue 32's kept gathers at 8B, in one job: `mfsdp train --model.preset 8b`
  # 1 x 4096 x 4, compiled, no AC, flat AdamW, steps 7-26 timed: FP8 tensorwise with every block's gather kept
  # (step 6 profiled: ranges, kernels, trimmed trace), bf16 with 16 and with 22 blocks kept; then FSDP2's best
  # fitting bf16 setting at the same shape (AC, bf16 reduction) if time is left.
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee "$OUT/nvidia_smi.txt"
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local C=(--nproc-per-node 1 --model.preset 8b --data.local_batch 1 --data.seq_len 4096 --data.microbatches 4
    --data.path /tmp/stdlib.tokens --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false
    --train.eval_every 0 --train.steps 26 --train.save_only_model true --train.adamw_kernel flat)
  profiled_row 8b_fp8_keep32 "${C[@]}" --model.float8 tensorwise --parallel.keep_gathered_blocks 32
  train_row 8b_bf16_keep16 7..26 "${C[@]}" --parallel.keep_gathered_blocks 16
  train_row 8b_bf16_keep22 7..26 "${C[@]}" --parallel.keep_gathered_blocks 22
  if [ $((585 - SECONDS)) -ge 150 ]; then
    IMPL_TIMEOUT=$((560 - SECONDS)) bench "$ROOT" fsdp2 --preset 8b --local-batch 1 --seq 4096 --microbatches 4 --ac \
      --compile --steps 6 --warmup 2 --grad-reduce-dtype bf16
    grep -h '^| fsdp2 ' "$OUT/bench.log"
  else echo "fsdp2 row skipped: $((585 - SECONDS)) s left"; fi
}

section_curves8b() {  # ONE GPU, <= 9.5 min: issue 32's FP8 loss curve at 8B, 60 steps beside bf16 (1 x 4096 x 4, the
  # defaults of `mfsdp train`: compiled, no AC, kept gathers "auto"); their speed over steps 7-60; then FSDP2's best
  # fitting bf16 setting at the same shape (AC, bf16 reduction) in the same job if time is left
  GPUS=1 STEPS=60 PRESET=8b LOCAL_BATCH=1 MICROBATCHES=4 timeout 420 bash benchmarks/fp8_loss_curves.sh /tmp/curves8b \
    > "$OUT/curves8b.log" 2>&1; echo "curves8b rc=$? at ${SECONDS}s"; grep -v "^W1" "$OUT/curves8b.log" | grep -i "auto\|final\|error" | tail -8
  mkdir -p "$OUT/curves8b"; cp /tmp/curves8b/fp8_vs_bf16.* "$OUT/curves8b/" 2>/dev/null
  for r in none tensorwise; do
    summarize_train /tmp/curves8b/$r 7..60 | tee -a "$OUT/curves8b.log"
    cp /tmp/curves8b/$r/metrics.jsonl "$OUT/curves8b/${r}_metrics.jsonl" 2>/dev/null
  done
  rm -rf /tmp/curves8b
  if [ $((585 - SECONDS)) -ge 150 ]; then
    IMPL_TIMEOUT=$((560 - SECONDS)) bench "$ROOT" fsdp2 --preset 8b --local-batch 1 --seq 4096 --microbatches 4 --ac \
      --compile --steps 6 --warmup 2 --grad-reduce-dtype bf16
    grep -h '^| fsdp2 ' "$OUT/bench.log"
  else echo "fsdp2 row skipped: $((585 - SECONDS)) s left"; fi
}

gpu_verify_main "$@"

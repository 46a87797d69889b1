#!/usr/bin/env bash
# The sections of benchmarks/gpu_verify.sh that measured this directory's results: calls 1-3 (`defaults11`, `curves1b`, with CURVES_BATCH=4 in call 3).
# Moved here from gpu_verify.sh as its last version had them; they run with its helpers and settings
# (bench, summarize_train, train_row, profiled_row; the NCCL variables of gpu_env.sh):
#
#   bash benchmarks/results/2026-12-03_h200x1_session11/gpu.sh SECTION...    # SECTION: defaults11 curves1b
#
# A record of what ran: a later tree may have renamed the flags they pass.
source "$(dirname "${BASH_SOURCE[0]}")/../../gpu_verify.sh"

section_defaults11() {  # ONE GPU, <= 9.5 min: issue 32 at `mfsdp train`'s defaults, in one job: 8B, 1 x 4096 x 4,
  # compiled, no AC, flat AdamW and kept gathers "auto" (no flag): bf16 over steps 7-26, then FP8 tensorwise with
  # step 6 profiled; FSDP2's best fitting bf16 setting at the same shape (AC, bf16 reduction); the flat AdamW GPU
  # tests if time is left
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee "$OUT/nvidia_smi.txt"
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local C=(--nproc-per-node 1 --model.preset 8b --data.local_batch 1 --data.seq_len 4096 --data.microbatches 4
    --data.path /tmp/stdlib.tokens --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false
    --train.eval_every 0 --train.steps 26 --train.save_only_model true)
  train_row 8b_bf16_defaults 7..26 "${C[@]}"
  grep -h "keep_gathered_blocks auto\|predicted\|memory" "$OUT/train_8b_bf16_defaults.log" | grep -v "^W1" | head -4
  profiled_row 8b_fp8_defaults "${C[@]}" --model.float8 tensorwise
  grep -h "keep_gathered_blocks auto\|predicted\|memory" "$OUT/train_8b_fp8_defaults.log" | grep -v "^W1" | head -4
  if [ $((585 - SECONDS)) -ge 150 ]; then
    IMPL_TIMEOUT=$((540 - SECONDS)) bench "$ROOT" fsdp2 --preset 8b --local-batch 1 --seq 4096 --microbatches 4 --ac \
      --compile --steps 6 --warmup 2 --grad-reduce-dtype bf16
    grep -h '^| fsdp2 ' "$OUT/bench.log"
  else echo "fsdp2 row skipped: $((585 - SECONDS)) s left"; fi
  if [ $((585 - SECONDS)) -ge 40 ]; then
    timeout $((580 - SECONDS)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flat_adamw.py 2>&1 | tail -3
  fi
}

section_curves1b() {  # ONE GPU, <= 9.5 min (4.5 at 8k tokens): the FP8 loss curve at 1b, 300 steps, beside bf16
  # and a bf16 control run (torch's fused AdamW: the floor of the comparison), 100 warm-up steps, CURVES_BATCH sequences of 4096 a step
  # (4, the default: the 16k tokens a step of issue 32's rows; 2: 8k) (issue 32)
  GPUS=1 STEPS=300 PRESET=1b CONTROL=1 LOCAL_BATCH=${CURVES_BATCH:-4} timeout 560 bash benchmarks/fp8_loss_curves.sh \
    /tmp/curves1b > "$OUT/curves1b.log" 2>&1
  echo "curves1b rc=$? at ${SECONDS}s"; grep -v "^W1" "$OUT/curves1b.log" | grep "final loss\|floor\|rror" | tail -5
  mkdir -p "$OUT/curves1b"; cp /tmp/curves1b/fp8_vs_bf16.* "$OUT/curves1b/" 2>/dev/null
  for r in none tensorwise control; do cp /tmp/curves1b/$r/metrics.jsonl "$OUT/curves1b/${r}_metrics.jsonl" 2>/dev/null; done
  rm -rf /tmp/curves1b
}

gpu_verify_main "$@"

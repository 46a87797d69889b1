#!/usr/bin/env bash
# The sections of benchmarks/gpu_verify.sh that measured this directory's results: calls 1-3 (`trace8b`, `flat8b`, `final9`); call 1's `curves1b` is in ../2026-12-03_h200x1_session11/gpu.sh.
# Moved here from gpu_verify.sh as its last version had them; they run with its helpers and settings
# (bench, summarize_train, train_row, profiled_row; the NCCL variables of gpu_env.sh):
#
#   bash benchmarks/results/2026-12-03_h200x1_session9/gpu.sh SECTION...    # SECTION: trace8b flat8b final9
#
# A record of what ran: a later tree may have renamed the flags they pass.
source "$(dirname "${BASH_SOURCE[0]}")/../../gpu_verify.sh"

section_trace8b() {  # ONE GPU, <= 6 min: issue 32's profile with its timeline: `mfsdp train --model.preset 8b`
  # 1 x 4096 x 4, compiled, no AC, bf16 then FP8 tensorwise, step 8 profiled; the breakdown by phase,
  # the kernels by name and the trace itself, trimmed and gzipped (benchmarks/trim_trace.py), to read here.
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local C=(--nproc-per-node 1 --model.preset 8b --data.local_batch 1 --data.seq_len 4096 --data.microbatches 4
    --data.path /tmp/stdlib.tokens --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false
    --train.eval_every 0 --train.steps 12 --train.profile_step 8 --train.save_only_model true ${TRACE8B_ARGS:-})
  local f8 name
  for f8 in none tensorwise; do
    name=$([ $f8 = none ] && echo bf16 || echo fp8)
    rm -rf /tmp/p8b; timeout 200 python3 -m mfsdp.cli train "${C[@]}" --model.float8 $f8 --train.out_dir /tmp/p8b \
      > "$OUT/train_8b_$name.log" 2>&1; echo "train 8b $name rc=$? at ${SECONDS}s"
    summarize_train /tmp/p8b 4..7 9..12 | tee -a "$OUT/train_8b_$name.log"
    cp /tmp/p8b/profile/step_8_breakdown.md "$OUT/profile_8b_${name}_ranges.md"
    timeout 60 python3 benchmarks/trace_breakdown.py kernels /tmp/p8b/profile/step_8_rank0.json \
      > "$OUT/profile_8b_${name}_kernels.txt" 2>&1; head -12 "$OUT/profile_8b_${name}_kernels.txt"
    timeout 60 python3 benchmarks/trace_breakdown.py idle /tmp/p8b/profile/step_8_rank0.json \
      > "$OUT/profile_8b_${name}_idle.txt" 2>&1; head -3 "$OUT/profile_8b_${name}_idle.txt"
    timeout 90 python3 benchmarks/trim_trace.py /tmp/p8b/profile/step_8_rank0.json "$OUT/trace_8b_${name}.json.gz"
    if [ "$(stat -c %s "$OUT/trace_8b_${name}.json.gz")" -gt 15000000 ]; then  # too big to come back: no aten ops
      python3 benchmarks/trim_trace.py /tmp/p8b/profile/step_8_rank0.json "$OUT/trace_8b_${name}.json.gz" --no-cpu-ops
    fi
    cp /tmp/p8b/metrics.jsonl "$OUT/train_8b_${name}_metrics.jsonl"; rm -rf /tmp/p8b
  done
}

section_flat8b() {  # ONE GPU, <= 9.5 min: issue 32's flat AdamW step at 8B, in one job: `mfsdp train --model.preset 8b`
  # 1 x 4096 x 4, compiled, no AC, steps 7-26 timed: bf16 with torch's fused AdamW (before), bf16 with the flat
  # step (after; step 6 profiled: ranges, kernels, trimmed trace), FP8 tensorwise with the flat step; then
  # FSDP2's best fitting bf16 setting at the same shape (AC, bf16 reduction), and FP8 rowwise if time is left.
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local C=(--nproc-per-node 1 --model.preset 8b --data.local_batch 1 --data.seq_len 4096 --data.microbatches 4
    --data.path /tmp/stdlib.tokens --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false
    --train.eval_every 0 --train.steps 26 --train.save_only_model true)
  train_row 8b_bf16_fused 7..26 "${C[@]}" --train.adamw_kernel fused
  profiled_row 8b_bf16_flat "${C[@]}"
  train_row 8b_fp8_flat 7..26 "${C[@]}" --model.float8 tensorwise
  if [ $((585 - SECONDS)) -ge 150 ]; then
    IMPL_TIMEOUT=$((560 - SECONDS)) bench "$ROOT" fsdp2 --preset 8b --local-batch 1 --seq 4096 --microbatches 4 --ac \
      --compile --steps 6 --warmup 2 --grad-reduce-dtype bf16
    grep -h '^| fsdp2 ' "$OUT/bench.log"
  else echo "fsdp2 row skipped: $((585 - SECONDS)) s left"; fi
  if [ $((585 - SECONDS)) -ge 130 ]; then train_row 8b_fp8_rowwise_flat 7..26 "${C[@]}" --model.float8 rowwise
  else echo "rowwise row skipped: $((585 - SECONDS)) s left"; fi
}

section_final9() {  # ONE GPU, <= 8 min, a session's last call: the GPU suite on the final tree; then, in one job,
  # 8B bf16 with the side streams at high priority (the default) and at default priority
  # (--parallel.high_priority_streams false), steps 7-14; then FP8 tensorwise at the default if time is left  issue 32
  timeout 290 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local C=(--nproc-per-node 1 --model.preset 8b --data.local_batch 1 --data.seq_len 4096 --data.microbatches 4
    --data.path /tmp/stdlib.tokens --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false
    --train.eval_every 0 --train.steps 14 --train.save_only_model true)
  local name args
  for name in bf16_high bf16_default fp8_high; do
    if [ $((470 - SECONDS)) -lt 95 ]; then echo "$name skipped: $((470 - SECONDS)) s left"; continue; fi
    args=(); [ $name = bf16_default ] && args=(--parallel.high_priority_streams false)
    [ $name = fp8_high ] && args=(--model.float8 tensorwise)
    train_row 8b_$name 7..14 "${C[@]}" "${args[@]}"
  done
}

gpu_verify_main "$@"

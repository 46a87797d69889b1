#!/usr/bin/env bash
# The sections of benchmarks/gpu_verify.sh that measured this directory's results: call 1 (`ratio8b`); call 2's `peaks8b` is `gpu_verify.sh peaks`.
# Moved here from gpu_verify.sh as its last version had them; they run with its helpers and settings
# (bench, summarize_train, train_row, profiled_row; the NCCL variables of gpu_env.sh):
#
#   bash benchmarks/results/2026-12-02_h200x1_session8/gpu.sh SECTION...    # SECTION: ratio8b
#
# A record of what ran: a later tree may have renamed the flags they pass.
source "$(dirname "${BASH_SOURCE[0]}")/../../gpu_verify.sh"

section_ratio8b() {  # ONE GPU, <= 9.5 min: issue 31's HF-vs-preset ratio, order swapped, with the clocks
  # `mfsdp train` 1 x 4096 x 4, compiled, no AC, defaults otherwise, same data and flags: a random
  # Llama-3-8B-shaped HF directory, --model.preset 8b (step 6 profiled), the HF directory again, then the
  # preset again if the call has the time (A B A B); steps 7-26 timed. nvidia-smi logs the SM clock,
  # power and throttle reasons every 500 ms, so a gap between two runs can be read against the clocks.
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local hf=/tmp/hf8b
  timeout 150 python3 benchmarks/make_hf_dir.py $hf --shape llama3-8b 2>&1 | tail -1
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 500 > "$OUT/smi.csv" 2>&1 &
  local smi=$!
  local A=(--nproc-per-node 1 --data.local_batch 1 --data.seq_len 4096 --data.microbatches 4
    --data.path /tmp/stdlib.tokens --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false
    --train.eval_every 0 --train.steps 26 --train.save_only_model true)
  local name
  for name in hf_bf16_1 preset_bf16_1 hf_bf16_2 preset_bf16_2; do
    if [ $((585 - SECONDS)) -lt 125 ]; then echo "$name skipped: $((585 - SECONDS)) s left"; break; fi
    local model=(--model.preset 8b) extra=()
    [ $name = preset_bf16_1 ] && extra=(--train.profile_step 6)
    case $name in hf_*) model=(--model.hf $hf);; esac
    rm -rf /tmp/r8b; echo "$name start $(date +%T)" >> "$OUT/smi_marks.txt"
    timeout $((585 - SECONDS)) python3 -m mfsdp.cli train "${A[@]}" "${model[@]}" "${extra[@]}" \
      --train.out_dir /tmp/r8b > "$OUT/train_8b_$name.log" 2>&1; echo "train 8b $name rc=$? at ${SECONDS}s"
    echo "$name end $(date +%T)" >> "$OUT/smi_marks.txt"
    grep -v "^W1" "$OUT/train_8b_$name.log" | grep "rror\|warning" | head -3
    summarize_train /tmp/r8b 7..26 | tee -a "$OUT/train_8b_$name.log"
    cp /tmp/r8b/metrics.jsonl "$OUT/train_8b_${name}_metrics.jsonl"
    if [ -n "${extra[*]}" ]; then
      cp /tmp/r8b/profile/step_6_breakdown.md "$OUT/profile_8b_${name}_ranges.md"
      timeout 60 python3 benchmarks/trace_breakdown.py kernels /tmp/r8b/profile/step_6_rank0.json \
        > "$OUT/profile_8b_${name}_kernels.txt" 2>&1
      head -30 "$OUT/profile_8b_${name}_kernels.txt"
    fi
    rm -rf /tmp/r8b
  done
  kill $smi 2>/dev/null; rm -rf $hf
}

gpu_verify_main "$@"

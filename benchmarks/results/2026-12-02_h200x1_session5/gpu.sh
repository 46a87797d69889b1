#!/usr/bin/env bash
# The sections of benchmarks/gpu_verify.sh that measured this directory's results: call 1 (`house`, with `.carry/base` at 5f63414): the files `call1_*`.
# Moved here from gpu_verify.sh as its last version had them; they run with its helpers and settings
# (bench, summarize_train, train_row, profiled_row; the NCCL variables of gpu_env.sh):
#
#   bash benchmarks/results/2026-12-02_h200x1_session5/gpu.sh SECTION...    # SECTION: house
#
# A record of what ran: a later tree may have renamed the flags they pass.
source "$(dirname "${BASH_SOURCE[0]}")/../../gpu_verify.sh"

section_house() {
  timeout 260 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  timeout 60 python3 -m mfsdp.cli train --nproc-per-node 1 --train.stepz 3 > "$OUT/bad_flag.log" 2>&1
  echo "bad flag through the launcher: rc=$? ($(grep -v '^W1' "$OUT/bad_flag.log" | tail -1))"
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local A=(--nproc-per-node 1 --model.preset 1b --data.local_batch 2 --data.seq_len 4096 --data.path /tmp/stdlib.tokens
    --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false --train.eval_every 0)
  rm -rf /tmp/house_head /tmp/house_base
  timeout 150 python3 -m mfsdp.cli train "${A[@]}" --train.steps 10 --train.out_dir /tmp/house_head \
    > "$OUT/train_1b_head.log" 2>&1; echo "train 1b HEAD rc=$?"; grep -v "^W1" "$OUT/train_1b_head.log" | tail -3
  summarize_train /tmp/house_head 4..10 | tee -a "$OUT/train_1b_head.log"
  cp /tmp/house_head/metrics.jsonl "$OUT/train_1b_head_metrics.jsonl"; rm -rf /tmp/house_head  # 18 GB
  (cd .carry/base && PYTHONPATH=$PWD timeout 150 python3 -m mfsdp.cli train "${A[@]}" --train.steps 10 \
    --train.out_dir /tmp/house_base > "$OUT/train_1b_base.log" 2>&1; echo "train 1b base rc=$?")
  summarize_train /tmp/house_base 4..10 | tee -a "$OUT/train_1b_base.log"
  cp /tmp/house_base/metrics.jsonl "$OUT/train_1b_base_metrics.jsonl"
  # HEAD resumes the base tree's checkpoint (written before the change) to step 13.
  timeout 130 python3 -m mfsdp.cli train "${A[@]}" --train.steps 13 --train.out_dir /tmp/house_base --resume \
    > "$OUT/train_1b_resume_base.log" 2>&1; echo "train 1b HEAD --resume of base's step_10 rc=$?"
  grep -v "^W1" "$OUT/train_1b_resume_base.log" | grep "resumed\|saved" | tail -3
  summarize_train /tmp/house_base 11..13 | tee -a "$OUT/train_1b_resume_base.log"
  rm -rf /tmp/house_head /tmp/house_base
}

gpu_verify_main "$@"

#!/usr/bin/env bash
# The sections of benchmarks/gpu_verify.sh that measured this directory's results: call 1 (`ft`, with `.carry/base` at c6db634).
# Moved here from gpu_verify.sh as its last version had them; they run with its helpers and settings
# (bench, summarize_train, train_row, profiled_row; the NCCL variables of gpu_env.sh):
#
#   bash benchmarks/results/2026-12-02_h200x1_session6/gpu.sh SECTION...    # SECTION: ft
#
# A record of what ran: a later tree may have renamed the flags they pass.
source "$(dirname "${BASH_SOURCE[0]}")/../../gpu_verify.sh"

section_ft() {
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local A=(--nproc-per-node 1 --model.preset 1b --data.local_batch 2 --data.seq_len 4096 --data.path /tmp/stdlib.tokens
    --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false --train.eval_every 0)
  rm -rf /tmp/ft_head /tmp/ft_base
  timeout 110 python3 -m mfsdp.cli train "${A[@]}" --train.steps 10 --train.out_dir /tmp/ft_head \
    --train.save_only_model true > "$OUT/train_1b_head.log" 2>&1; echo "train 1b HEAD (model-only save) rc=$?"
  grep -v "^W1" "$OUT/train_1b_head.log" | tail -3; du -sh /tmp/ft_head/checkpoints/step_10
  summarize_train /tmp/ft_head 4..10 | tee -a "$OUT/train_1b_head.log"
  timeout 90 python3 -m mfsdp.cli train "${A[@]}" --train.steps 13 --train.out_dir /tmp/ft_head --resume \
    --train.save_only_model true > "$OUT/train_1b_resume.log" 2>&1; echo "train 1b HEAD --resume of a model-only save rc=$?"
  grep -v "^W1" "$OUT/train_1b_resume.log" | grep "resumed\|saved" | tail -3
  summarize_train /tmp/ft_head 11..13 | tee -a "$OUT/train_1b_resume.log"
  cp /tmp/ft_head/metrics.jsonl "$OUT/train_1b_head_metrics.jsonl"; rm -rf /tmp/ft_head
  (cd .carry/base && PYTHONPATH=$PWD timeout 110 python3 -m mfsdp.cli train "${A[@]}" --train.steps 10 \
    --train.out_dir /tmp/ft_base > "$OUT/train_1b_base.log" 2>&1; echo "train 1b base rc=$?")
  summarize_train /tmp/ft_base 4..10 | tee -a "$OUT/train_1b_base.log"
  cp /tmp/ft_base/metrics.jsonl "$OUT/train_1b_base_metrics.jsonl"; rm -rf /tmp/ft_base
  local hf=/tmp/hf_1b
  timeout 90 python3 benchmarks/make_hf_dir.py $hf/model --shape llama3.2-1b --rows $hf/rows.jsonl --n-rows 3000 \
    2>&1 | tail -1
  python3 -m mfsdp.cli prepare-data $hf/rows.jsonl $hf/chat.tokens --model.hf $hf/model | tee "$OUT/sft_prepare.log"
  timeout 150 python3 -m mfsdp.cli train --nproc-per-node 1 --model.hf $hf/model --data.path $hf/chat.tokens \
    --data.seq_len 4096 --data.local_batch 1 --data.microbatches 2 --train.steps 24 --train.eval_every 12 \
    --train.save_only_model true --train.export_hf true --train.sample_tokens 24 --train.progress false \
    --train.out_dir $hf/run > "$OUT/sft_1b.log" 2>&1; echo "sft 1b-shaped HF dir rc=$?"
  grep -v "^W1" "$OUT/sft_1b.log" | grep -v "^ *$" | tail -14
  summarize_train $hf/run 6..24 | tee -a "$OUT/sft_1b.log"
  cp $hf/run/metrics.jsonl "$OUT/sft_1b_metrics.jsonl"
  python3 -c "import transformers, torch; m = transformers.AutoModelForCausalLM.from_pretrained('$hf/run/hf', \
torch_dtype=torch.bfloat16); t = transformers.AutoTokenizer.from_pretrained('$hf/run/hf'); \
print('from_pretrained:', type(m).__name__, sum(p.numel() for p in m.parameters()), 'params, chat template', \
t.chat_template is not None)" 2>&1 | tail -1 | tee -a "$OUT/sft_1b.log"
  rm -rf $hf
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
}

gpu_verify_main "$@"

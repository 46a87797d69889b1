#!/usr/bin/env bash
# The sections of benchmarks/gpu_verify.sh that measured this directory's results: calls 1-3 (`rows8b`, `sft8b`, `levers8b`).
# Moved here from gpu_verify.sh as its last version had them; they run with its helpers and settings
# (bench, summarize_train, train_row, profiled_row; the NCCL variables of gpu_env.sh):
#
#   bash benchmarks/results/2026-12-02_h200x1_session7/gpu.sh SECTION...    # SECTION: rows8b sft8b levers8b
#
# A record of what ran: a later tree may have renamed the flags they pass.
source "$(dirname "${BASH_SOURCE[0]}")/../../gpu_verify.sh"

section_rows8b() {  # ONE GPU, <= 9.5 min: issue 31's HF row beside the preset and issue 32's profiles
  # `mfsdp train` 1 x 4096 x 4, compiled, no AC, exact AdamW, the defaults otherwise, same data and flags:
  # --model.preset 8b (bf16), a random Llama-3-8B-shaped HF directory, then the preset in FP8 tensorwise
  # if the call has the time. Step 6 is profiled; steps 7-26 are timed (20 steps).
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local hf=/tmp/hf8b
  timeout 150 python3 benchmarks/make_hf_dir.py $hf --shape llama3-8b 2>&1 | tail -1; du -sh $hf
  local A=(--nproc-per-node 1 --data.local_batch 1 --data.seq_len 4096 --data.microbatches 4
    --data.path /tmp/stdlib.tokens --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false
    --train.eval_every 0 --train.steps 26 --train.profile_step 6 --train.save_only_model true)
  local name model
  for name in preset_bf16 hf_bf16 preset_fp8; do
    case $name in
      preset_bf16) model=(--model.preset 8b);;
      hf_bf16) model=(--model.hf $hf);;
      preset_fp8) model=(--model.preset 8b --model.float8 tensorwise)
        if [ $((560 - SECONDS)) -lt 150 ]; then echo "preset_fp8 skipped: $((560 - SECONDS)) s left"; break; fi;;
    esac
    rm -rf /tmp/r8b; timeout 220 python3 -m mfsdp.cli train "${A[@]}" "${model[@]}" --train.out_dir /tmp/r8b \
      > "$OUT/train_8b_$name.log" 2>&1; echo "train 8b $name rc=$? at ${SECONDS}s"
    grep -v "^W1" "$OUT/train_8b_$name.log" | grep "mfsdp train:\|loaded\|profiled\|rror" | head -4
    summarize_train /tmp/r8b 7..26 | tee -a "$OUT/train_8b_$name.log"
    cp /tmp/r8b/metrics.jsonl "$OUT/train_8b_${name}_metrics.jsonl"
    cp /tmp/r8b/profile/step_6_breakdown.md "$OUT/profile_8b_${name}_ranges.md"
    timeout 60 python3 benchmarks/trace_breakdown.py kernels /tmp/r8b/profile/step_6_rank0.json \
      > "$OUT/profile_8b_${name}_kernels.txt" 2>&1
    timeout 40 python3 benchmarks/trace_breakdown.py idle /tmp/r8b/profile/step_6_rank0.json \
      > "$OUT/profile_8b_${name}_idle.txt" 2>&1
    [ $name = hf_bf16 ] && rm -rf $hf
    rm -rf /tmp/r8b
  done
  if [ $((585 - SECONDS)) -gt 45 ]; then  # the head + loss alone at the 8B shape, plain against fused
    timeout $((585 - SECONDS)) python3 benchmarks/loss_bench.py --tokens 4096 --iters 10 --out "$OUT/loss_bench.jsonl" \
      2>&1 | grep -v "^W1" | tail -4
  fi
}

section_sft8b() {  # ONE GPU, <= 9.5 min: issue 31's 8B fine-tune on the 64 GiB disk, then the Qwen row if time
  # A random Llama-3-8B-shaped HF directory (15 GB) and synthetic chat rows; prepare-data through its
  # chat template; `mfsdp train --model.hf DIR` at its defaults (the fine-tuning recipe), 1 x 4096 x 4,
  # with a validation loss, a model-only save and the HF export; then from_pretrained on the export.
  local hf=/tmp/sft8b
  timeout 150 python3 benchmarks/make_hf_dir.py $hf/model --shape llama3-8b --rows $hf/rows.jsonl --n-rows 8000 \
    2>&1 | tail -1
  python3 -m mfsdp.cli prepare-data $hf/rows.jsonl $hf/chat.tokens --model.hf $hf/model 2>&1 | tee "$OUT/sft8b_prepare.log"
  df -h /tmp | tail -1
  timeout 330 python3 -m mfsdp.cli train --nproc-per-node 1 --model.hf $hf/model --data.path $hf/chat.tokens \
    --data.seq_len 4096 --data.local_batch 1 --data.microbatches 4 --train.steps 30 --train.eval_every 15 \
    --train.checkpoint_every 0 --train.save_only_model true --train.export_hf true --train.sample_tokens 24 \
    --train.progress false --train.out_dir $hf/run > "$OUT/sft8b.log" 2>&1; echo "sft 8B-shaped HF dir rc=$? at ${SECONDS}s"
  grep -v "^W1" "$OUT/sft8b.log" | grep -v "^ *$" | tail -16
  summarize_train $hf/run 6..30 | tee -a "$OUT/sft8b.log"
  cp $hf/run/metrics.jsonl "$OUT/sft8b_metrics.jsonl"
  du -sh $hf/model $hf/run/checkpoints/* $hf/run/hf 2>&1 | tee -a "$OUT/sft8b.log"; df -h /tmp | tail -1 | tee -a "$OUT/sft8b.log"
  timeout 120 python3 -c "import transformers, torch; m = transformers.AutoModelForCausalLM.from_pretrained('$hf/run/hf', \
torch_dtype=torch.bfloat16); t = transformers.AutoTokenizer.from_pretrained('$hf/run/hf'); \
print('from_pretrained:', type(m).__name__, sum(p.numel() for p in m.parameters()), 'params, chat template', \
t.chat_template is not None)" 2>&1 | tail -1 | tee -a "$OUT/sft8b.log"
  rm -rf $hf
  if [ $((585 - SECONDS)) -lt 200 ]; then echo "qwen row skipped: $((585 - SECONDS)) s left"; return; fi
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  timeout 150 python3 benchmarks/make_hf_dir.py /tmp/qwen --shape qwen2.5-7b 2>&1 | tail -1
  rm -rf /tmp/rq; timeout $((585 - SECONDS)) python3 -m mfsdp.cli train --nproc-per-node 1 --model.hf /tmp/qwen \
    --data.local_batch 1 --data.seq_len 4096 --data.microbatches 4 --data.path /tmp/stdlib.tokens \
    --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false --train.eval_every 0 --train.steps 26 \
    --train.save_only_model true --train.out_dir /tmp/rq > "$OUT/train_qwen7b.log" 2>&1; echo "train qwen2.5-7b rc=$?"
  grep -v "^W1" "$OUT/train_qwen7b.log" | grep "mfsdp train:\|loaded\|rror" | head -3
  summarize_train /tmp/rq 7..26 | tee -a "$OUT/train_qwen7b.log"
  cp /tmp/rq/metrics.jsonl "$OUT/train_qwen7b_metrics.jsonl"; rm -rf /tmp/rq /tmp/qwen
}

section_levers8b() {  # ONE GPU, <= 9.5 min: issue 32's levers at 8B and the planner's new points
  # The attention backends at the 8B shape; `mfsdp train` 1 x 4096 x 4, compiled, no AC: --model.preset 8b
  # (bf16, step 6 profiled: ranges, kernels by name), a random Llama-3-8B-shaped HF directory at its
  # defaults, the preset in FP8 tensorwise; steps 7-20 timed. Then 1b, 2 x 4096, fp32 gradients: its peak.
  timeout 90 python3 benchmarks/attention_bench.py --out "$OUT/attention_bench.jsonl" 2>&1 | grep -v "^W1" \
    | cut -c1-170
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local hf=/tmp/hf8b
  timeout 150 python3 benchmarks/make_hf_dir.py $hf --shape llama3-8b 2>&1 | tail -1
  local A=(--nproc-per-node 1 --data.local_batch 1 --data.seq_len 4096 --data.microbatches 4
    --data.path /tmp/stdlib.tokens --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false
    --train.eval_every 0 --train.steps 20 --train.save_only_model true)
  local name
  for name in preset_bf16 hf_bf16 preset_fp8; do
    if [ $((585 - SECONDS)) -lt 120 ]; then echo "$name skipped: $((585 - SECONDS)) s left"; break; fi
    local model=(--model.preset 8b) extra=()
    [ $name = preset_bf16 ] && extra=(--train.profile_step 6)
    [ $name = hf_bf16 ] && model=(--model.hf $hf)
    [ $name = preset_fp8 ] && extra=(--model.float8 tensorwise)
    rm -rf /tmp/r8b; timeout $((585 - SECONDS)) python3 -m mfsdp.cli train "${A[@]}" "${model[@]}" "${extra[@]}" \
      --train.out_dir /tmp/r8b > "$OUT/train_8b_$name.log" 2>&1; echo "train 8b $name rc=$? at ${SECONDS}s"
    grep -v "^W1" "$OUT/train_8b_$name.log" | grep "rror\|warning" | head -3
    summarize_train /tmp/r8b 7..20 | tee -a "$OUT/train_8b_$name.log"
    cp /tmp/r8b/metrics.jsonl "$OUT/train_8b_${name}_metrics.jsonl"
    if [ $name = preset_bf16 ]; then
      cp /tmp/r8b/profile/step_6_breakdown.md "$OUT/profile_8b_${name}_ranges.md"
      timeout 60 python3 benchmarks/trace_breakdown.py kernels /tmp/r8b/profile/step_6_rank0.json \
        > "$OUT/profile_8b_${name}_kernels.txt" 2>&1
      head -45 "$OUT/profile_8b_${name}_kernels.txt"
    fi
    [ $name = hf_bf16 ] && rm -rf $hf
    rm -rf /tmp/r8b
  done
  rm -rf $hf
  if [ $((585 - SECONDS)) -gt 60 ]; then
    rm -rf /tmp/r1b; timeout $((585 - SECONDS)) python3 -m mfsdp.cli train --nproc-per-node 1 --model.preset 1b \
      --data.local_batch 2 --data.seq_len 4096 --data.path /tmp/stdlib.tokens --parallel.main_grads_dtype fp32 \
      --train.steps 8 --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false --train.eval_every 0 \
      --train.save_only_model true --train.out_dir /tmp/r1b > "$OUT/train_1b_fp32.log" 2>&1; echo "train 1b fp32 rc=$?"
    summarize_train /tmp/r1b 4..8 | tee -a "$OUT/train_1b_fp32.log"; cp /tmp/r1b/metrics.jsonl "$OUT/train_1b_fp32_metrics.jsonl"
    rm -rf /tmp/r1b
  fi
}

gpu_verify_main "$@"

#!/usr/bin/env bash
# The GPU checks the open issues wait for, in sections that each fit one device call (<= 10 min).
#
#   bash benchmarks/gpu_verify.sh SECTION...     # SECTION: smoke fp8_8b tests ab step fp8 tp resume memory ckpt
#
# Run from the repository root on the device, with $OUT set (the device tool sets it) and, carried:
#   .whl/          pytest, pluggy, iniconfig and torchao 0.17.0 wheels (the device has no registry)
#   .carry/base/   a worktree of the commit to compare against (`git worktree add --detach
#                  .carry/base <commit>`), for the `ab` section only
# Sections:
#   house   ONE GPU, <= 9 min, after a change to mfsdp train's code: `pytest -m gpu tests`, a bad flag
#           through the launcher, `mfsdp train` 1b compiled for 10 steps then --resume to 14, and
#           the same 1b run at .carry/base, the speed of both in one job                  issue 33
#   ft      ONE GPU, <= 9 min, after the fine-tuning change: `mfsdp train` 1b compiled for 10 steps with
#           --train.save_only_model (async, bf16) then --resume to 13; the same 1b run at .carry/base
#           in the same job; a random Llama-3.2-1B-shaped HF directory fine-tuned on synthetic chat rows
#           (bundled route, packed, compiled) with --train.export_hf; then `pytest -m gpu tests`  issue 31
#   profile8b ONE GPU, <= 6 min: `mfsdp train --model.preset 8b` 1 x 4096 x 4, compiled, no AC, bf16 and
#           FP8 tensorwise, each with --train.profile_step 8: their breakdowns by phase    issue 32
#   rows8b  ONE GPU, <= 9.5 min: a random Llama-3-8B-shaped HF directory at its defaults beside
#           --model.preset 8b (bf16), then the preset in FP8, 1 x 4096 x 4, compiled, no AC, step 6
#           profiled (ranges, kernels by category, idle gaps), steps 7-26 timed   issues 31 32
#   sft8b   ONE GPU, <= 9.5 min: a random Llama-3-8B-shaped HF directory fine-tuned on synthetic chat
#           rows at its defaults, model-only save + HF export on the 64 GiB disk, from_pretrained;
#           then a Qwen2.5-7B-shaped directory's row if the call has the time         issue 31
#   levers8b ONE GPU, <= 9.5 min: the attention backends at 8B; `mfsdp train` 8b bf16 (profiled), the HF
#           8B directory at its defaults and 8b FP8, in one job; 1b with fp32 gradients (its peak)  31 32
#   ratio8b ONE GPU, <= 9.5 min: the HF 8B directory and --model.preset 8b, A B A B in one job, 20 timed steps
#           each, nvidia-smi clocks and power beside them                              issues 31 32
#   peaks8b ONE GPU, <= 6 min: 8B FP8 tensorwise and 1b fp32-gradient peaks (the planner tests' figures)  32
#   final   ONE GPU, <= 8 min, the last call of a session whose time is short: the GPU suite, the
#           compiled 1b rows in bf16 and FP8, and 8B + AC without offload (bf16 gradients)  issues 19 21 22
#   smoke   ONE GPU, <= 9 min, first in any session that touches GPU code: `pytest -m gpu tests`,
#           the compiled 1b rows (mfsdp, FSDP2; bf16 and FP8 with FP8 all-gather), and `mfsdp train`
#           1b for 10 steps (fp32 reduction, compiled) then --resume to 14 (its bf16 default)  issue 19
#   fp8_8b  ONE GPU: the 8B layer shape cut to 16 layers, 2 x 8192 with AC, compiled: mfsdp and
#           FSDP2 + torchao in FP8, mfsdp in bf16; and `mfsdp train` FP8 against bf16        issue 19
#   tests   every GPU test (conditional computation incl. HSDP/HFSDP on the GPUs at hand, streams,
#           float8, deterministic resume)                                             issues 12 13 16
#   ab      1b and 8b+AC: mfsdp at HEAD and at .carry/base beside FSDP2, one job each       issue 12
#   step    1b and 8b+AC: the early gathers during the optimizer step, on and off (one lever) issue 16
#   fp8     8B compiled, FP8 tensorwise with FP8 all-gather: mfsdp, FSDP2+torchao; and the
#           bf16 compiled rows in the same call                                             issue 16
#   tp      HF 1B at tp=2 (local and DTensor activation paths) beside dp=2 and FSDP2+TP     issue 15
#   resume  the 2-GPU 1b resume with identical losses (deterministic mode)                  issue 13
#   memory  planner accuracy at the new grid points (hf-1b dp=2 and tp=2, moe-1b)           issue 14
#   offload ONE GPU, <= 10 min: 8B with a quarter of the optimizer on the host beside FSDP2 (AC), mfsdp
#           (AC) and FSDP2 + CPUOffloadPolicy at 16k tokens per step, then mfsdp-offload at 64k   issue 21
#   offload_train ONE GPU, <= 6 min: the GPU offload tests; `mfsdp train` 1b, half offloaded against
#           none, deterministic, 20 steps: losses side by side and the speed          issue 21
#   ckpt    1b on one GPU: the training stall per checkpoint save, synchronous against
#           --train.async_checkpoint true, and the step time during a background write against
#           steps with no save in flight; at most two 18 GB checkpoints on disk       issue 20
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
ROOT=$PWD
OUT=${OUT:-$ROOT/runs/gpu_verify}
mkdir -p "$OUT"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
if ! python3 -c "import pytest, torchao" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
RUN="python3 -m torch.distributed.run --standalone --nproc-per-node $NGPU"
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, \
'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())" | tee "$OUT/versions.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/versions.txt"

section_tests() {
  timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_conditional.py tests/test_gpu.py \
    tests/test_float8.py tests/test_gpu_train_resume.py tests/test_gpu_step_overlap.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
}

bench() {  # TREE IMPLS ARGS... -> one JSON line per implementation in $OUT/bench_TREE.jsonl
  # IMPL_TIMEOUT (s) bounds each implementation (raise it for compiled 8B runs).
  local tree=$1 impls=$2; shift 2
  local per=${IMPL_TIMEOUT:-130} n; n=$(echo "$impls" | tr ',' '\n' | wc -l)
  (cd "$tree" && PYTHONPATH=$PWD:$PYTHONPATH timeout $((per * n + 40)) $RUN benchmarks/throughput.py \
     --impl "$impls" --impl-timeout "$per" --out "$OUT/bench_$(basename "$tree").jsonl" "$@" >> "$OUT/bench.log" 2>&1
   echo "bench $tree $impls $* rc=$?")
}

summarize_train() {  # RUN_DIR FIRST..LAST...: median tokens/s of metrics.jsonl over step ranges
  python3 - "$@" <<'PYEOF'
import json, statistics, sys
rows = {r["step"]: r for r in map(json.loads, open(sys.argv[1] + "/metrics.jsonl"))}
for span in sys.argv[2:]:
    a, b = map(int, span.split(".."))
    got = [rows[s] for s in range(a, b + 1) if s in rows]
    if got:
        print(f"train {sys.argv[1]} steps {span}: median {statistics.median(r['tokens_per_s'] for r in got):,.0f} tok/s, "
              f"loss {got[0]['loss']:.3f} -> {got[-1]['loss']:.3f}, peak {max(r['peak_mem_gib'] for r in got):.2f} GiB")
PYEOF
}

section_smoke() {
  timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  local rows="--preset 1b --local-batch 2 --seq 4096 --compile --steps 8 --warmup 3"
  IMPL_TIMEOUT=100 bench "$ROOT" mfsdp,fsdp2 $rows
  IMPL_TIMEOUT=100 bench "$ROOT" mfsdp,fsdp2 $rows --float8 tensorwise --fp8-all-gather
  local run=/tmp/smoke_train A=(--nproc-per-node 1 --model.preset 1b --data.local_batch 2 --data.seq_len 4096
    --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false --train.out_dir /tmp/smoke_train)
  rm -rf $run
  timeout 130 python3 -m mfsdp.cli train "${A[@]}" --train.steps 10 --parallel.main_grads_dtype fp32 \
    > "$OUT/train_1b.log" 2>&1; echo "train 1b (fp32 reduction) rc=$?"; grep -v "^W1" "$OUT/train_1b.log" | tail -6
  timeout 130 python3 -m mfsdp.cli train "${A[@]}" --train.steps 14 --resume >> "$OUT/train_1b.log" 2>&1
  echo "train 1b --resume (bf16 reduction) rc=$?"; grep -v "^W1" "$OUT/train_1b.log" | tail -5
  summarize_train $run 4..10 12..14 | tee -a "$OUT/train_1b.log"
  cp $run/metrics.jsonl "$OUT/train_1b_metrics.jsonl"; rm -rf $run
}

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

section_profile8b() {
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local A=(--nproc-per-node 1 --model.preset 8b --data.local_batch 1 --data.seq_len 4096 --data.microbatches 4
    --data.path /tmp/stdlib.tokens --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false
    --train.eval_every 0 --train.steps 10 --train.profile_step 8 --train.save_only_model true)
  for f8 in none tensorwise; do
    local name; name=$([ $f8 = none ] && echo bf16 || echo fp8)
    rm -rf /tmp/p8b; timeout 170 python3 -m mfsdp.cli train "${A[@]}" --model.float8 $f8 --train.out_dir /tmp/p8b \
      > "$OUT/train_8b_$name.log" 2>&1; echo "train 8b float8=$f8 rc=$?"
    summarize_train /tmp/p8b 4..7 | tee -a "$OUT/train_8b_$name.log"
    cp /tmp/p8b/profile/step_8_breakdown.md "$OUT/profile_8b_${name}_breakdown.md"
    cp /tmp/p8b/metrics.jsonl "$OUT/train_8b_${name}_metrics.jsonl"; rm -rf /tmp/p8b
  done
}

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

train_row() {  # NAME SPAN ARGS...: one `mfsdp train` run into /tmp/row, its median over SPAN, its metrics kept
  local name=$1 span=$2; shift 2
  rm -rf /tmp/row; timeout $((585 - SECONDS)) python3 -m mfsdp.cli train "$@" --train.out_dir /tmp/row \
    > "$OUT/train_$name.log" 2>&1; echo "train $name rc=$? at ${SECONDS}s"
  summarize_train /tmp/row $span | tee -a "$OUT/train_$name.log"
  cp /tmp/row/metrics.jsonl "$OUT/train_${name}_metrics.jsonl"; rm -rf /tmp/row
}

profiled_row() {  # NAME ARGS...: `mfsdp train` with step 6 profiled, its median over steps 7-26, metrics, the
  # breakdown by phase, the kernels by name and the trimmed trace (no host ops)
  local name=$1; shift
  rm -rf /tmp/p8b; timeout $((585 - SECONDS)) python3 -m mfsdp.cli train "$@" --train.profile_step 6 \
    --train.out_dir /tmp/p8b > "$OUT/train_$name.log" 2>&1; echo "train $name rc=$? at ${SECONDS}s"
  summarize_train /tmp/p8b 7..26 | tee -a "$OUT/train_$name.log"
  cp /tmp/p8b/metrics.jsonl "$OUT/train_${name}_metrics.jsonl"
  cp /tmp/p8b/profile/step_6_breakdown.md "$OUT/profile_${name}_ranges.md"
  timeout 60 python3 benchmarks/trace_breakdown.py kernels /tmp/p8b/profile/step_6_rank0.json \
    > "$OUT/profile_${name}_kernels.txt" 2>&1; head -12 "$OUT/profile_${name}_kernels.txt"
  timeout 60 python3 benchmarks/trim_trace.py /tmp/p8b/profile/step_6_rank0.json "$OUT/trace_${name}.json.gz" \
    --no-cpu-ops; rm -rf /tmp/p8b
}

section_peaks8b() {  # ONE GPU, <= 6 min: the measured peaks the planner's tests hold it to, after a model change
  # `mfsdp train --model.preset 8b --model.float8 tensorwise` 1 x 4096 x 4, compiled, no AC (steps 7-26 timed),
  # then --model.preset 1b at 2 x 4096 with fp32 gradients (steps 4-8).
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local C=(--nproc-per-node 1 --data.seq_len 4096 --data.path /tmp/stdlib.tokens --train.sample_tokens 0
    --train.checkpoint_every 0 --train.progress false --train.eval_every 0 --train.save_only_model true)
  train_row 8b_preset_fp8 7..26 "${C[@]}" --model.preset 8b --model.float8 tensorwise --data.local_batch 1 \
    --data.microbatches 4 --train.steps 26
  train_row 1b_fp32 4..8 "${C[@]}" --model.preset 1b --data.local_batch 2 --parallel.main_grads_dtype fp32 --train.steps 8
}

section_final() {  # ONE GPU, <= 8 min: the GPU suite, the compiled 1b rows (bf16, FP8) and 8B without offload
  timeout 255 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  local rows="--preset 1b --local-batch 2 --seq 4096 --compile --steps 8 --warmup 3"
  IMPL_TIMEOUT=75 bench "$ROOT" mfsdp,fsdp2 $rows
  IMPL_TIMEOUT=75 bench "$ROOT" mfsdp,fsdp2 $rows --float8 tensorwise --fp8-all-gather
  # issue 21's first target: 8B on one GPU without offload, bf16 gradients (mfsdp train's default), AC
  IMPL_TIMEOUT=75 bench "$ROOT" mfsdp,fsdp2 --preset 8b --local-batch 1 --seq 4096 --ac --compile --steps 5 \
    --warmup 2 --grad-reduce-dtype bf16
  grep -h '^| \(mfsdp\|fsdp2\) ' "$OUT/bench.log"
}

section_first_big_run() {  # issue 25's 8b command on one GPU, with what a smoke call leaves (>= 100 s)
  local left=$((590 - SECONDS)) run=/tmp/big8b
  if [ $left -lt 100 ]; then echo "first_big_run: skipped, ${left} s left"; return; fi
  local A=(--model.preset 8b --data.seq_len 4096 --data.local_batch 1 --parallel.activation_checkpointing true
    --train.sample_tokens 0 --train.progress false --train.out_dir $run)
  rm -rf $run
  # The launcher first: a 96 GB checkpoint does not fit this 64 GB disk, refused before any worker.
  timeout 60 python3 -m mfsdp.cli train --nproc-per-node 1 "${A[@]}" --train.steps 20 2>&1 | grep -v "^W1" | tail -2
  # Then the worker alone, memory check on, killed before its final save (there is no room for it).
  timeout -s KILL $((590 - SECONDS)) python3 -m mfsdp.train "${A[@]}" --train.steps 1000 --train.skip_disk_check true \
    > "$OUT/big8b.log" 2>&1
  grep -v "^W1" "$OUT/big8b.log" | grep -v Warning | head -8
  python3 - $run/metrics.jsonl <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("8b first steps: loss", " ".join(f"{r['loss']:.2f}" for r in rows[:20]), f"({len(rows)} steps;",
      f"peak {max(r['peak_mem_gib'] for r in rows):.2f} GiB, {rows[-1]['tokens_per_s']:,.0f} tok/s at the last)")
PYEOF
  cp $run/metrics.jsonl "$OUT/big8b_metrics.jsonl" 2>/dev/null; rm -rf $run
}

section_fp8_8b_profile() {  # what is left of a 600 s call after smoke: one profiled step of each 8B FP8 row
  local left=$((585 - SECONDS)) tr=/tmp/fp8_traces
  if [ -n "${PROFILE_S:-}" ] && [ "$PROFILE_S" -lt $left ]; then left=$PROFILE_S; fi  # leave room for what follows
  if [ $left -lt 100 ]; then echo "fp8_8b_profile: skipped, ${left} s left"; return; fi
  rm -rf $tr
  timeout $left $RUN benchmarks/throughput.py --impl fsdp2,mfsdp --impl-timeout $((left / 2 - 5)) --preset 8b \
    --n-layers 16 --local-batch 2 --seq 8192 --ac --compile --steps 2 --warmup 2 --float8 tensorwise --fp8-all-gather \
    --profile --trace-dir $tr --out "$OUT/fp8_8b_profile.jsonl" >> "$OUT/bench.log" 2>&1; echo "fp8_8b_profile rc=$?"
  ls $tr/*.json >/dev/null 2>&1 && python3 benchmarks/trace_breakdown.py kernels $tr/8b_fsdp2_rank0.json \
    $tr/8b_mfsdp_rank0.json > "$OUT/fp8_8b_breakdown.txt" 2>&1; tail -40 "$OUT/fp8_8b_breakdown.txt" 2>/dev/null
  for t in $tr/*_rank0.json; do  # the GPU events alone, gzipped, so that the traces come back (16 MiB a file)
    python3 - "$t" "$OUT/$(basename "$t" .json).gpu.json.gz" <<'PYEOF'
import gzip, json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
keep = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")]
with gzip.open(sys.argv[2], "wt") as f:
    json.dump({"traceEvents": keep}, f)
PYEOF
  done
}

section_fp8_8b() {  # ~1.5 min per compiled implementation, ~1.5 min per train run
  local rows="--preset 8b --n-layers 16 --local-batch 2 --seq 8192 --ac --compile --steps 6 --warmup 2"
  IMPL_TIMEOUT=150 bench "$ROOT" mfsdp,fsdp2 $rows --float8 tensorwise --fp8-all-gather
  IMPL_TIMEOUT=150 bench "$ROOT" mfsdp $rows
  # `mfsdp train` itself, FP8 against bf16. A worker run alone (a world of one) and killed after its
  # timed steps: the final save of a 4.5B model (54 GB of fp32 state) would not fit the disk.
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local A=(--model.preset 8b --model.n_layers 16 --data.local_batch 2 --data.seq_len 8192 --data.path /tmp/stdlib.tokens
    --parallel.activation_checkpointing true --train.steps 1000 --train.progress false --train.sample_tokens 0)
  for f8 in tensorwise none; do
    rm -rf /tmp/t8b_$f8
    timeout -s KILL ${TRAIN_8B_S:-110} python3 -m mfsdp.train "${A[@]}" --model.float8 $f8 --train.out_dir /tmp/t8b_$f8 \
      > "$OUT/train_8b16_$f8.log" 2>&1
    grep -v "^W1" "$OUT/train_8b16_$f8.log" | grep -v Warning | tail -3
    summarize_train /tmp/t8b_$f8 4..1000 | tee -a "$OUT/train_8b16_$f8.log"
    cp /tmp/t8b_$f8/metrics.jsonl "$OUT/train_8b16_${f8}_metrics.jsonl" 2>/dev/null; rm -rf /tmp/t8b_$f8
  done
}

section_ab() {
  bench "$ROOT" fsdp2,mfsdp --preset 1b --local-batch 2 --seq 4096
  bench "$ROOT/.carry/base" mfsdp --preset 1b --local-batch 2 --seq 4096
  bench "$ROOT" mfsdp --preset 8b --local-batch 1 --seq 4096 --ac
  bench "$ROOT/.carry/base" mfsdp --preset 8b --local-batch 1 --seq 4096 --ac
}

section_step() {
  bench "$ROOT" mfsdp,mfsdp-step1,fsdp2 --preset 1b --local-batch 2 --seq 4096 --profile
  bench "$ROOT" mfsdp,mfsdp-step1 --preset 8b --local-batch 1 --seq 4096 --ac
}

section_fp8() {  # compiled 8B: ~2-3 min per implementation; the bf16 rows fit a second call if need be
  IMPL_TIMEOUT=200 bench "$ROOT" mfsdp,fsdp2 --preset 8b --local-batch 1 --seq 4096 --compile --float8 tensorwise \
    --fp8-all-gather
  IMPL_TIMEOUT=150 bench "$ROOT" mfsdp,fsdp2 --preset 8b --local-batch 1 --seq 4096 --compile
}

section_tp() {
  timeout 200 $RUN benchmarks/tp_host_overhead.py --device cuda --layers 16 --hidden 2048 --heads 32 \
    --kv-heads 8 --vocab 128256 --seq 4096 --batch 2 --dtype bf16 --steps 10 --out "$OUT/tp_host.jsonl" \
    > "$OUT/tp_host.log" 2>&1; echo "tp_host rc=$?"
  timeout 300 $RUN benchmarks/hf_manager.py --tp 2 --impl mfsdp,fsdp2,mfsdp-dp --tp-path local \
    --out "$OUT/hf_tp.jsonl" > "$OUT/hf_tp_local.log" 2>&1; echo "hf tp local rc=$?"
  timeout 150 $RUN benchmarks/hf_manager.py --tp 2 --impl mfsdp --tp-path dtensor \
    --out "$OUT/hf_tp.jsonl" > "$OUT/hf_tp_dtensor.log" 2>&1; echo "hf tp dtensor rc=$?"
}

section_resume() {
  timeout 560 bash benchmarks/results/deterministic_resume.sh /tmp/det1b 2>&1 | tee "$OUT/resume.log" | tail -15
}

section_memory() {
  for args in "--models hf-1b" "--models hf-1b --tp 2" "--models moe-1b --expert-units off on"; do
    timeout 280 $RUN benchmarks/memory_accuracy.py $args --out "$OUT/memory_$(echo $args | tr -c 'a-z0-9' _).md" \
      >> "$OUT/memory.log" 2>&1; echo "memory $args rc=$?"
  done
}

section_ckpt() {  # ~6 min on GPU 0, alone in a call: a sync 1b run, then an async one spaced by it
  # sync:  60 steps, a save every 20: each save stalls training for its whole write, and no write
  #        overlaps a step, so its steps are the no-save baseline. It also measures the write
  #        (the stall) and the step time, which space the async run's saves.
  # async: saves CKPT_EVERY steps apart (default: 1.6 write times of steps, >= 100), 3 of them
  #        (2 when the time left is short; the last is the final save, written as the run ends).
  #        The first save's line says how long the staging buffer took to page-lock in the
  #        background (from step 1 on); the steps after the first save, until its write ends,
  #        are the steps during a background write.
  # keep_checkpoints 1: one published checkpoint plus the one being written (2 x 18 GB at most);
  # each run's directory is deleted before the next starts. CKPT_BUDGET_S (560) bounds the section.
  local t0=$SECONDS budget=${CKPT_BUDGET_S:-560} dir=${CKPT_DIR:-/tmp/mfsdp_ckpt}
  local data=/tmp/mfsdp_ckpt_data/stdlib.tokens free every steps limit rc
  mkdir -p "$(dirname "$data")" "$(dirname "$dir")"
  rm -rf "$dir" "$OUT"/ckpt_*
  free=$(df -P -B1 "$(dirname "$dir")" | awk 'NR == 2 {print $4}')
  if [ "${free:-0}" -lt $((40 * 1024 ** 3)) ]; then
    echo "RESULT ckpt: skipped, $(( ${free:-0} / 1024 ** 3 )) GiB free under $(dirname "$dir") (40 needed)"
    return
  fi
  [ -s "$data" ] || timeout 120 python3 -m mfsdp.cli prepare-data stdlib "$data" > "$OUT/ckpt_data.log" 2>&1
  local args=(--model.preset 1b --data.path "$data" --data.seq_len 4096 --data.local_batch 2
              --parallel.compute_dtype bf16 --train.warmup_steps 2 --train.lr 3e-4 --train.sample_tokens 0
              --train.eval_every 0 --train.progress false --train.keep_checkpoints 1 --train.out_dir "$dir")
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 240 python3 -m mfsdp.train "${args[@]}" --train.async_checkpoint false \
    --train.steps 60 --train.checkpoint_every 20 > "$OUT/ckpt_sync.log" 2>&1
  rc=$?; echo "ckpt sync rc=$rc after $((SECONDS - t0)) s (log: $OUT/ckpt_sync.log)"
  cp "$dir/metrics.jsonl" "$OUT/ckpt_sync.metrics.jsonl" 2>/dev/null
  rm -rf "$dir"
  limit=$((budget - (SECONDS - t0) - 15))
  read -r every steps < <(python3 - "$OUT" "$limit" "${CKPT_EVERY:-0}" <<'EOF'
import json, math, re, statistics, sys
out, limit, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    log = open(f"{out}/ckpt_sync.log").read()
    stalls = [float(w) for w in re.findall(r"saved: training waited ([0-9.]+) s for the whole write", log)]
    rows = [json.loads(line) for line in open(f"{out}/ckpt_sync.metrics.jsonl")]
    step = statistics.median(r["step_time_s"] for r in rows if r["step"] > 5)
    write = statistics.median(stalls)
except (OSError, ValueError, KeyError, statistics.StatisticsError):
    step, write = 0.2, 30.0  # the sync run failed: a 1b step and save on one H200, roughly
every = every or max(100, 10 * math.ceil(1.6 * write / step / 10))
startup = 90 + write  # build, compile and the first steps, then the final save's write
saves = 3 if startup + 3 * every * step <= limit else 2
print(every, saves * every)
EOF
)
  echo "ckpt async: $steps steps, a save every $every, within $limit s"
  CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$limit" python3 -m mfsdp.train "${args[@]}" --train.async_checkpoint true \
    --train.steps "${steps:-200}" --train.checkpoint_every "${every:-100}" > "$OUT/ckpt_async.log" 2>&1
  rc=$?; echo "ckpt async rc=$rc after $((SECONDS - t0)) s (log: $OUT/ckpt_async.log)"
  cp "$dir/metrics.jsonl" "$OUT/ckpt_async.metrics.jsonl" 2>/dev/null
  rm -rf "$dir"
  grep -h "checkpoint.*saved\|staged in about\|Error\|error" "$OUT"/ckpt_sync.log "$OUT"/ckpt_async.log | head -20
  python3 - "$OUT" <<'EOF' | tee "$OUT/ckpt_summary.txt"
import json, math, re, statistics, sys
out = sys.argv[1]


def text(name):
    try:
        return open(f"{out}/ckpt_{name}.log").read()
    except OSError:
        return ""


def step_times(name):  # step -> step_time_s, past compilation and warm-up
    try:
        rows = [json.loads(line) for line in open(f"{out}/ckpt_{name}.metrics.jsonl")]
    except (OSError, ValueError):
        return {}
    return {r["step"]: r["step_time_s"] for r in rows if r["step"] > 5}


def median(values):
    return statistics.median(values) if values else math.nan


sync = [float(w) for w in re.findall(r"saved: training waited ([0-9.]+) s for the whole write", text("sync"))]
n = r"[0-9.]+"
writes = [m.groupdict() for m in re.finditer(
    rf"checkpoint step_(?P<step>\d+) saved: training waited (?P<stall>{n}) s to stage it \(previous "
    rf"write (?P<previous>{n}) s(?:, page-locking (?P<pinning>{n}) s)?, copy (?P<copy>{n}) s, "
    rf"planning (?P<planning>{n}) s\), then it was written in the background in (?P<written>{n}) s"
    rf"(?:, over steps (?P<first>\d+)-(?P<last>\d+)|, as the run ended)"
    rf"(?:; its staging buffer \((?P<gib>{n}) GiB\) was allocated and page-locked in the background in "
    rf"(?P<made>{n}) s)?", text("async"))]
print("== checkpoint saves: 1b, one GPU, seq 4096 x local batch 2, bf16")
print("sync saves, training stall: " + (", ".join(f"{w:.2f} s" for w in sync) or "none found"))
during, made = set(), None
for w in writes:
    span = f"steps {w['first']}-{w['last']} ran meanwhile" if w["first"] else "written as the run ended"
    print(f"async save step_{w['step']}: stall {w['stall']} s = previous write {w['previous']} + page-locking "
          f"{w['pinning'] or '0.00'} + copy {w['copy']} + planning {w['planning']}; written in {w['written']} s; {span}")
    if w["made"]:
        made = float(w["made"])
        print(f"  staging buffer: {w['gib']} GiB, allocated and page-locked in the background in {made:.2f} s")
    if w["first"]:  # the write ended during step `last`: steps first..last-1 ran wholly during it
        during.update(range(int(w["first"]), int(w["last"])))
if not writes:
    print("async saves: none found")
sync_steps, async_steps = step_times("sync"), step_times("async")
base = median(list(sync_steps.values()))
# Steps 2.. ran while the buffer was page-locked (it starts after step 1): kept out of the quiet steps.
pinned_by = 2 + math.ceil((made or 0) / base) if base == base else 2
pinning = [t for s, t in async_steps.items() if s <= pinned_by]
quiet = [t for s, t in async_steps.items() if s > pinned_by and s not in during and s - 1 not in during]
busy = [t for s, t in async_steps.items() if s in during]
stalls = [float(w["stall"]) for w in writes]
summary = {
    "sync_stall_s": sync, "async_stall_s": stalls,
    "async_breakdown_s": [{k: float(w[k] or 0) for k in ("previous", "pinning", "copy", "planning")} for w in writes],
    "async_written_s": [float(w["written"]) for w in writes], "pin_background_s": made,
    "step_s_no_save_sync": base, "step_s_quiet_async": median(quiet), "step_s_during_write": median(busy),
    "step_s_during_pinning": median(pinning), "steps_during_write": len(busy),
}
json.dump(summary, open(f"{out}/ckpt_summary.json", "w"), indent=1)
print(f"step time (median): no save in flight {base:.3f} s (sync run, {len(sync_steps)} steps), "
      f"{median(quiet):.3f} s (async run, {len(quiet)} quiet steps); during a background write "
      f"{median(busy):.3f} s ({len(busy)} steps); while the buffer was page-locked {median(pinning):.3f} s "
      f"({len(pinning)} steps)")
print(f"RESULT ckpt stall per save: sync median {median(sync):.2f} s; async median {median(stalls):.2f} s, "
      f"max {max(stalls, default=math.nan):.2f} s over {len(stalls)} saves (target <= 2 s)")
print(f"RESULT ckpt steps during a background write: {base / median(busy):.3f}x the sync run's no-save steps, "
      f"{median(quiet) / median(busy):.3f}x the async run's quiet steps (target >= 0.95)")
print(f"RESULT ckpt page-locking in the background: {made if made is not None else math.nan:.2f} s after step 1; "
      f"the steps meanwhile (6-{pinned_by}) ran at {median(quiet) / median(pinning):.3f}x the quiet steps")
EOF
  echo "ckpt: $((SECONDS - t0)) s"
}

section_offload() {  # ONE GPU, <= 10 min: issue 21's rows. 8B, seq 4096, exact AdamW (no clip), compiled,
  # one job: mfsdp with a quarter of its units' optimizer on the host (no AC: the freed memory pays for the
  # activations), FSDP2 and mfsdp with AC and no offload, at 16k tokens per step (1 x 4096 x 4
  # microbatches); mfsdp-offload at 64k (x 16); FSDP2 with CPUOffloadPolicy. The GPU offload tests first.
  local t0=$SECONDS tr=/tmp/offload_traces
  timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_offload_gpu.py 2>&1 | tail -4
  local C="--preset 8b --seq 4096 --local-batch 1 --compile --grad-reduce-dtype bf16"
  local O="--offload ${OFFLOAD_F:-0.25} --offload-threads ${OFFLOAD_THREADS:-14}"
  rm -rf $tr
  IMPL_TIMEOUT=130 bench "$ROOT" mfsdp-offload $C --microbatches 4 --warmup 2 --steps 4 $O --profile --trace-dir $tr
  IMPL_TIMEOUT=100 bench "$ROOT" fsdp2,mfsdp $C --microbatches 4 --warmup 2 --steps 4 --ac
  IMPL_TIMEOUT=120 bench "$ROOT" mfsdp-offload $C --microbatches 16 --warmup 1 --steps 3 $O
  # Last: FSDP2's CPUOffloadPolicy keeps fp32 parameters, gradients and AdamW states on the host
  # (16 bytes per parameter: 120 GiB at 8B), at the edge of a 125 GiB host.
  local left=$((565 - (SECONDS - t0)))
  if [ $left -ge 80 ]; then IMPL_TIMEOUT=$((left - 40)) bench "$ROOT" fsdp2-offload $C --microbatches 4 --warmup 1 --steps 2
  else echo "fsdp2-offload row: skipped, ${left} s left"; fi
  grep -h '^| \(mfsdp\|fsdp2\)' "$OUT/bench.log"
  ls $tr/*offload*rank0.json >/dev/null 2>&1 && python3 benchmarks/trace_breakdown.py idle $tr/*offload*rank0.json \
    > "$OUT/offload_idle.txt" 2>&1; head -30 "$OUT/offload_idle.txt" 2>/dev/null
  python3 - "$OUT" <<'PYEOF'
import glob, json, sys
for path in glob.glob(sys.argv[1] + "/bench_*.jsonl"):
    for r in map(json.loads, open(path)):
        if r.get("preset") == "8b" and r.get("status") == "ok":
            p = r.get("profile") or {}
            print("RESULT", r["impl"], f"mb={r.get('microbatches')} ac={r.get('ac')}", f"{r['tokens_per_s_per_gpu']:,.0f} tok/s",
                  f"peak {r['peak_mem_alloc_gib']} GiB, host RSS {r.get('host_rss_peak_gib')} GiB",
                  f"offload host {r.get('offload_host_gib')}", f"counts {r.get('offload_counts')}",
                  f"step() {r.get('optimizer_step_call_s_median')} s", f"profiled step: span {p.get('gpu_span_ms')} ms, compute idle "
                  f"{p['gpu_span_ms'] - p['compute_busy_ms'] if 'compute_busy_ms' in p else None} ms, all streams idle {p.get('gpu_idle_ms')} ms")
PYEOF
  echo "offload: $((SECONDS - t0)) s"
}

section_offload_train() {  # ONE GPU, <= 6 min: the GPU offload tests, then `mfsdp train` 1b for 20 steps in
  # deterministic mode with half the units' optimizer on the host against --parallel.offload auto
  # (none there): losses side by side, and the speed with pretraining's clip biting every step.
  local t0=$SECONDS
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_offload_gpu.py 2>&1 | tail -4
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local A=(--nproc-per-node 1 --model.preset 1b --data.local_batch 2 --data.seq_len 4096 --data.path /tmp/stdlib.tokens
    --train.steps 20 --train.sample_tokens 0 --train.checkpoint_every 0 --train.progress false --train.eval_every 0
    --parallel.deterministic true)
  for mode in auto optimizer; do
    local extra=(); [ $mode = optimizer ] && extra=(--parallel.offload_fraction 0.5)
    rm -rf /tmp/off_$mode
    timeout 150 python3 -m mfsdp.cli train "${A[@]}" --parallel.offload $mode "${extra[@]}" --train.out_dir /tmp/off_$mode \
      > "$OUT/train_offload_$mode.log" 2>&1; echo "train 1b --parallel.offload $mode rc=$?"
    grep -i 'offload' "$OUT/train_offload_$mode.log" | grep -v "^W1" | head -3
    cp /tmp/off_$mode/metrics.jsonl "$OUT/train_offload_${mode}_metrics.jsonl" 2>/dev/null; rm -rf /tmp/off_$mode
  done
  python3 - "$OUT" <<'PYEOF'
import json, statistics, sys
rows = {m: [json.loads(l) for l in open(f"{sys.argv[1]}/train_offload_{m}_metrics.jsonl")] for m in ("auto", "optimizer")}
a, b = ({r["step"]: r["loss"] for r in rows[m] if "loss" in r} for m in ("auto", "optimizer"))
rel = [abs(a[s] - b[s]) / abs(a[s]) for s in sorted(a) if s in b]
speed = {m: statistics.median(r["tokens_per_s"] for r in rows[m][4:]) for m in rows}
print(f"RESULT train 1b deterministic, offload 0.5 vs none: {len(rel)} steps, max rel loss diff {max(rel):.2e}, "
      f"first {rel[0]:.2e}, last {rel[-1]:.2e}; tok/s (median, steps 5-20): none {speed['auto']:,.0f}, "
      f"offload {speed['optimizer']:,.0f}; grad norms {[round(r.get('grad_norm', 0), 1) for r in rows['optimizer'][:6]]}")
PYEOF
  echo "offload_train: $((SECONDS - t0)) s"
}

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

section_ab22() {  # ONE GPU, <= 9 min: the GPU suite, then the compiled 1b bf16 rows of HEAD beside .carry/base (the
  # tree before the runtime redesign, 89acf2b) in one job, HEAD first and last (issue 22: within 2 %)
  timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  local rows="--preset 1b --local-batch 2 --seq 4096 --compile --steps 8 --warmup 3"
  IMPL_TIMEOUT=90 bench "$ROOT" mfsdp,fsdp2 $rows
  IMPL_TIMEOUT=90 bench "$ROOT/.carry/base" mfsdp $rows
  [ $SECONDS -lt 500 ] && IMPL_TIMEOUT=90 bench "$ROOT" mfsdp $rows
  grep -h '^| \(mfsdp\|fsdp2\) ' "$OUT/bench.log"
}

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

# At most 8 files come back from a device call: everything leaves in one tarball.
# Trimmed traces (trace_*.json.gz, up to 16 MiB each) come back beside it, as files of their own.
trap 'cd "$OUT" && tar czf /tmp/results.tgz --exclude="./trace_*" . \
  && find . -mindepth 1 -maxdepth 1 ! -name "trace_*" -exec rm -rf {} + && mv /tmp/results.tgz .' EXIT
for section in "$@"; do
  echo "== $section $(date +%T)"
  "section_$section"
done

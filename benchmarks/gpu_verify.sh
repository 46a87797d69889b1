#!/usr/bin/env bash
# The GPU checks the open issues wait for, in sections that each fit one device call (<= 10 min).
#
#   bash benchmarks/gpu_verify.sh SECTION...     # SECTION: smoke fp8_8b tests ab step fp8 tp resume memory
#
# Run from the repository root on the device, with $OUT set (the device tool sets it) and, carried:
#   .whl/          pytest, pluggy, iniconfig and torchao 0.17.0 wheels (the device has no registry)
#   .carry/base/   a worktree of the commit to compare against (`git worktree add --detach
#                  .carry/base <commit>`), for the `ab` section only
# Sections:
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
  timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
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

for section in "$@"; do
  echo "== $section $(date +%T)"
  "section_$section"
done

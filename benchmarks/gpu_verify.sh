#!/usr/bin/env bash
# The reusable GPU checks and measurements, in sections that each fit one device call (<= 10 min).
#
#   bash benchmarks/gpu_verify.sh SECTION...      # e.g. smoke; or ab_trees with AB_BASE=.carry/base
#
# Run from the repository root on the device, with $OUT set (the device tool sets it; else
# runs/gpu_verify) and, carried: .whl/ (pytest, pluggy, iniconfig and torchao 0.17.0 wheels: the device
# has no registry); for ab_trees, the older tree (`git worktree add --detach .carry/base <commit>`, or a
# copy of one) in an ignored folder. Sections run on every GPU of the machine unless they say ONE GPU.
#
#   smoke    ONE GPU, <= 9 min, first in any session that touches GPU code: the GPU suite, the compiled
#            1b rows (mfsdp, FSDP2; bf16, and FP8 with FP8 all-gather), `mfsdp train` 1b for 10 steps
#            (fp32 reduction, compiled), then --resume to 14 (its bf16 default)
#   tests    the GPU suite, `pytest -m gpu tests` (TESTS_TIMEOUT s, 560)
#   rows     throughput.py rows in one job: each `;`-separated entry of ROWS (its flags; default the
#            compiled 1b row) for IMPLS (mfsdp,fsdp2), at TREE (this one), IMPL_TIMEOUT s an impl (130)
#   train    `mfsdp train` rows in one job: each `;`-separated entry of TRAIN_ROWS (flags after seq 4096 on
#            the stdlib corpus, model-only saves; default 8B, 1 x 4096 x 4), TRAIN_STEPS (26), median over
#            TRAIN_SPAN (7..26); with PROFILE_STEP set, every row profiles that step (ranges, kernels, trace)
#   peaks    ONE GPU, <= 6 min: the measured peaks the planner's tests hold it to: 8B FP8 tensorwise
#            1 x 4096 x 4 (steps 7-26) and 1b 2 x 4096 with fp32 gradients (steps 4-8)
#   memory   the planner's prediction against the measured peak, over MEMORY_ARGS (`;`-separated
#            memory_accuracy.py flags; on one GPU `--models 1b`, on more the HF 1B at dp and tp=2, moe-1b)
#   fp8_loss_curves  ONE GPU (CURVES_GPUS), <= 9.5 min: FP8 against bf16, same seeds and data
#            (fp8_loss_curves.sh): CURVES_PRESET (1b), CURVES_STEPS (300), CURVES_BATCH (4) x
#            CURVES_MICROBATCHES (1) sequences of 4096, a bf16 control run unless CURVES_CONTROL=0
#   ab_trees ONE GPU, <= 9.5 min: compiled `mfsdp train` (AB_ARGS, default 1b, 2 x 4096, 30 steps) of this
#            tree and of the tree at $AB_BASE, alternately, this tree first (AB_ROUNDS pairs, 2): the
#            median tok/s of each run over AB_SPAN (11..30), each tree's mean and the ratio this / base
#
# A section that served one measurement lives beside its results, in benchmarks/results/*/gpu.sh,
# and runs through this file's helpers: `bash benchmarks/results/DIR/gpu.sh SECTION`.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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

train_row() {  # NAME SPAN ARGS...: one `mfsdp train` run into /tmp/row, its median over SPAN, its metrics kept
  local name=$1 span=$2; shift 2
  rm -rf /tmp/row; timeout $((585 - SECONDS)) python3 -m mfsdp.cli train "$@" --train.out_dir /tmp/row \
    > "$OUT/train_$name.log" 2>&1; echo "train $name rc=$? at ${SECONDS}s"
  summarize_train /tmp/row $span | tee -a "$OUT/train_$name.log"
  cp /tmp/row/metrics.jsonl "$OUT/train_${name}_metrics.jsonl"; rm -rf /tmp/row
}

profiled_row() {  # NAME ARGS...: `mfsdp train` with step PROFILE_STEP (6) profiled, its median over TRAIN_SPAN
  # (7..26), metrics, the breakdown by phase, the kernels by name and the trimmed trace (no host ops)
  local name=$1 step=${PROFILE_STEP:-6}; shift
  rm -rf /tmp/p8b; timeout $((585 - SECONDS)) python3 -m mfsdp.cli train "$@" --train.profile_step "$step" \
    --train.out_dir /tmp/p8b > "$OUT/train_$name.log" 2>&1; echo "train $name rc=$? at ${SECONDS}s"
  summarize_train /tmp/p8b "${TRAIN_SPAN:-7..26}" | tee -a "$OUT/train_$name.log"
  cp /tmp/p8b/metrics.jsonl "$OUT/train_${name}_metrics.jsonl"
  cp /tmp/p8b/profile/step_${step}_breakdown.md "$OUT/profile_${name}_ranges.md"
  timeout 60 python3 benchmarks/trace_breakdown.py kernels /tmp/p8b/profile/step_${step}_rank0.json \
    > "$OUT/profile_${name}_kernels.txt" 2>&1; head -12 "$OUT/profile_${name}_kernels.txt"
  timeout 60 python3 benchmarks/trim_trace.py /tmp/p8b/profile/step_${step}_rank0.json "$OUT/trace_${name}.json.gz" \
    --no-cpu-ops; rm -rf /tmp/p8b
}

split_rows() {  # VAR TEXT: the `;`-separated entries of TEXT into the array VAR
  IFS=';' read -ra "$1" <<< "$2"
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

section_tests() {
  timeout "${TESTS_TIMEOUT:-560}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -25
}

section_rows() {  # e.g. ROWS="--preset 8b --local-batch 1 --seq 4096 --ac --compile; --preset 1b --compile"
  local rows row
  split_rows rows "${ROWS:---preset 1b --local-batch 2 --seq 4096 --compile --steps 8 --warmup 3}"
  for row in "${rows[@]}"; do
    bench "${TREE:-$ROOT}" "${IMPLS:-mfsdp,fsdp2}" $row
  done
  grep -h '^| \(mfsdp\|fsdp2\|megatron\|none\)' "$OUT/bench.log"
}

section_train() {  # e.g. TRAIN_ROWS="--model.preset 8b --data.local_batch 1 --data.microbatches 4 --model.float8 tensorwise"
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local C=(--nproc-per-node "$NGPU" --data.seq_len 4096 --data.path /tmp/stdlib.tokens --train.sample_tokens 0
    --train.checkpoint_every 0 --train.progress false --train.eval_every 0 --train.save_only_model true
    --train.steps "${TRAIN_STEPS:-26}")
  local rows row i=0
  split_rows rows "${TRAIN_ROWS:---model.preset 8b --data.local_batch 1 --data.microbatches 4}"
  for row in "${rows[@]}"; do
    i=$((i + 1)); echo "row$i: $row" | tee -a "$OUT/train_rows.txt"
    if [ $((585 - SECONDS)) -lt "${ROW_S:-120}" ]; then echo "row$i skipped: $((585 - SECONDS)) s left"; continue; fi
    if [ -n "${PROFILE_STEP:-}" ]; then profiled_row "row$i" "${C[@]}" $row
    else train_row "row$i" "${TRAIN_SPAN:-7..26}" "${C[@]}" $row; fi
  done
}

section_peaks() {  # the figures tests/test_memory_float8.py and tests/test_train_compile.py quote
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local C=(--nproc-per-node 1 --data.seq_len 4096 --data.path /tmp/stdlib.tokens --train.sample_tokens 0
    --train.checkpoint_every 0 --train.progress false --train.eval_every 0 --train.save_only_model true)
  train_row 8b_preset_fp8 7..26 "${C[@]}" --model.preset 8b --model.float8 tensorwise --data.local_batch 1 \
    --data.microbatches 4 --train.steps 26
  train_row 1b_fp32 4..8 "${C[@]}" --model.preset 1b --data.local_batch 2 --parallel.main_grads_dtype fp32 --train.steps 8
}

section_memory() {
  local grid="--models 1b"
  [ "$NGPU" -gt 1 ] && grid="--models hf-1b; --models hf-1b --tp 2; --models moe-1b --expert-units off on"
  local runs args
  split_rows runs "${MEMORY_ARGS:-$grid}"
  for args in "${runs[@]}"; do
    timeout 280 $RUN benchmarks/memory_accuracy.py $args --out "$OUT/memory_$(echo $args | tr -c 'a-z0-9' _).md" \
      >> "$OUT/memory.log" 2>&1; echo "memory $args rc=$?"
  done
  cat "$OUT"/memory_*.md 2>/dev/null | grep "^|" | head -40
}

section_fp8_loss_curves() {
  local dir=/tmp/curves steps=${CURVES_STEPS:-300} r
  GPUS=${CURVES_GPUS:-1} STEPS=$steps PRESET=${CURVES_PRESET:-1b} CONTROL=${CURVES_CONTROL:-1} \
    LOCAL_BATCH=${CURVES_BATCH:-4} MICROBATCHES=${CURVES_MICROBATCHES:-1} \
    timeout $((585 - SECONDS)) bash benchmarks/fp8_loss_curves.sh $dir > "$OUT/curves.log" 2>&1
  echo "fp8_loss_curves rc=$? at ${SECONDS}s"; grep -v "^W1" "$OUT/curves.log" | grep "final loss\|floor\|rror" | tail -5
  mkdir -p "$OUT/curves"; cp $dir/fp8_vs_bf16.* "$OUT/curves/" 2>/dev/null
  for r in none tensorwise control; do
    [ -f $dir/$r/metrics.jsonl ] || continue
    summarize_train $dir/$r 7..$steps | tee -a "$OUT/curves.log"
    cp $dir/$r/metrics.jsonl "$OUT/curves/${r}_metrics.jsonl"
  done
  rm -rf $dir
}

section_ab_trees() {  # AB_BASE=.carry/base: this tree against an older one, in one job
  local base=${AB_BASE:-}
  if [ -z "$base" ] || [ ! -d "$base/mfsdp" ]; then
    echo "ab_trees: AB_BASE must name the older tree's root (a folder holding mfsdp/), e.g. AB_BASE=.carry/base;" \
      "got '$base'"; return 1
  fi
  base=$(cd "$base" && pwd)
  python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
  local A=(--nproc-per-node 1 --data.path /tmp/stdlib.tokens --train.sample_tokens 0 --train.checkpoint_every 0
    --train.progress false --train.eval_every 0)
  local extra=(${AB_ARGS:---model.preset 1b --data.local_batch 2 --data.seq_len 4096 --train.steps 30
    --train.save_only_model true})
  local round tree dir run_s=${AB_RUN_S:-150}
  echo "ab_trees: this tree $ROOT ($(git rev-parse --short HEAD 2>/dev/null)), base $base" \
    "($(git -C "$base" rev-parse --short HEAD 2>/dev/null)); ${extra[*]}" | tee "$OUT/ab_trees.txt"
  for dir in "$ROOT" "$base"; do  # each run must import its own tree's mfsdp
    (cd "$dir" && PYTHONPATH=$dir:$PYTHONPATH python3 -c "import mfsdp; print('imports', mfsdp.__file__)") \
      2>/dev/null | tee -a "$OUT/ab_trees.txt"
  done
  for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    if [ $((585 - SECONDS)) -lt $((2 * run_s)) ]; then echo "round $round skipped: $((585 - SECONDS)) s left"; break; fi
    for tree in this base; do
      dir=$ROOT; [ $tree = base ] && dir=$base
      rm -rf /tmp/ab_run
      (cd "$dir" && PYTHONPATH=$dir:$PYTHONPATH timeout "$run_s" python3 -m mfsdp.cli train "${A[@]}" "${extra[@]}" \
        --train.out_dir /tmp/ab_run > "$OUT/ab_${tree}_$round.log" 2>&1; echo "train $tree round $round rc=$? at ${SECONDS}s")
      cp /tmp/ab_run/metrics.jsonl "$OUT/ab_${tree}_${round}_metrics.jsonl" 2>/dev/null; rm -rf /tmp/ab_run
    done
  done
  python3 - "$OUT" "${AB_SPAN:-11..30}" <<'PYEOF' | tee -a "$OUT/ab_trees.txt"
import glob, json, re, statistics, sys
out, (a, b) = sys.argv[1], map(int, sys.argv[2].split(".."))
rates = {"this": {}, "base": {}}
for path in sorted(glob.glob(f"{out}/ab_*_metrics.jsonl")):
    tree, rnd = re.match(r".*/ab_(this|base)_(\d+)_metrics.jsonl", path).groups()
    got = [r["tokens_per_s"] for r in map(json.loads, open(path)) if a <= r["step"] <= b]
    if got:
        rates[tree][int(rnd)] = statistics.median(got)
for rnd in sorted(set(rates["this"]) & set(rates["base"])):
    t, s = rates["this"][rnd], rates["base"][rnd]
    print(f"round {rnd}: this {t:,.0f} tok/s, base {s:,.0f} tok/s, this / base {t / s:.4f}")
if rates["this"] and rates["base"]:
    t, s = statistics.mean(rates["this"].values()), statistics.mean(rates["base"].values())
    print(f"RESULT ab_trees steps {a}-{b}: this {t:,.0f} tok/s ({len(rates['this'])} runs), base {s:,.0f} tok/s "
          f"({len(rates['base'])} runs), this / base {t / s:.4f}")
else:
    print("RESULT ab_trees: no complete run of both trees (see ab_*.log)")
PYEOF
}

gpu_verify_main() {  # SECTION...: each section in turn
  # At most 8 files come back from a device call: everything leaves in one tarball.
  # Trimmed traces (trace_*.json.gz, up to 16 MiB each) come back beside it, as files of their own.
  trap 'cd "$OUT" && tar czf /tmp/results.tgz --exclude="./trace_*" . \
    && find . -mindepth 1 -maxdepth 1 ! -name "trace_*" -exec rm -rf {} + && mv /tmp/results.tgz .' EXIT
  local section
  for section in "$@"; do
    echo "== $section $(date +%T)"
    if declare -F "section_$section" > /dev/null; then "section_$section"
    else echo "no section $section; sections: $(declare -F | sed -n 's/^declare -f section_//p' | tr '\n' ' ')"; fi
  done
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then gpu_verify_main "$@"; fi

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

section_ckpt() {  # ~6 min: two 1b runs on GPU 0; CKPT_DIR needs ~40 GB free (two checkpoints at most)
  # sync:  60 steps, a save every 20. Each save stalls for its whole write and no write ever overlaps
  #        a step, so its steps are also the no-save baseline.
  # async: CKPT_STEPS (210) steps, a save every CKPT_EVERY (70). The first save also allocates and
  #        page-locks the staging buffer; later ones reuse it.
  # keep_checkpoints 1: one published checkpoint plus the one being written; each run's directory
  # is deleted before the next starts.
  local dir=${CKPT_DIR:-/tmp/mfsdp_ckpt} data=/tmp/mfsdp_ckpt_data/stdlib.tokens
  mkdir -p "$(dirname "$data")"
  [ -f "$data" ] || python3 -m mfsdp.cli prepare-data stdlib "$data" > "$OUT/ckpt_data.log" 2>&1
  local args=(--model.preset 1b --data.path "$data" --data.seq_len 4096 --data.local_batch 2
              --parallel.compute_dtype bf16 --train.warmup_steps 2 --train.lr 3e-4 --train.sample_tokens 0
              --train.progress false --train.keep_checkpoints 1)
  local name limit
  for name in sync async; do
    rm -rf "$dir"
    if [ "$name" = sync ]; then
      limit=240; set -- --train.async_checkpoint false --train.steps 60 --train.checkpoint_every 20
    else
      limit=300; set -- --train.async_checkpoint true --train.steps "${CKPT_STEPS:-210}" \
        --train.checkpoint_every "${CKPT_EVERY:-70}"
    fi
    CUDA_VISIBLE_DEVICES=0 timeout $limit python3 -m mfsdp.train "${args[@]}" --train.out_dir "$dir" "$@" \
      > "$OUT/ckpt_$name.log" 2>&1
    echo "ckpt $name rc=$? (log: $OUT/ckpt_$name.log)"
    cp "$dir/metrics.jsonl" "$OUT/ckpt_$name.metrics.jsonl" 2>/dev/null
    rm -rf "$dir"
  done
  python3 - "$OUT" <<'EOF' | tee "$OUT/ckpt_summary.txt"
import json, math, re, statistics, sys
out = sys.argv[1]


def text(name):
    try:
        return open(f"{out}/ckpt_{name}.log").read()
    except OSError:
        return ""


def step_times(name):  # step -> step_time_s, past warm-up and autotuning
    try:
        rows = [json.loads(line) for line in open(f"{out}/ckpt_{name}.metrics.jsonl")]
    except (OSError, ValueError):
        return {}
    return {r["step"]: r["step_time_s"] for r in rows if r["step"] > 5}


def median(values):
    return statistics.median(values) if values else math.nan


sync = [(int(s), float(w)) for s, w in re.findall(
    r"checkpoint step_(\d+) saved: training waited ([0-9.]+) s for the whole write", text("sync"))]
writes = re.findall(r"checkpoint step_(\d+) saved: training waited ([0-9.]+) s to stage it, then it was "
                    r"written in the background in ([0-9.]+) s(?:, over steps (\d+)-(\d+)|, as the run ended)",
                    text("async"))
staged = re.search(r"staged in about ([0-9.]+ [GM]iB)", text("async"))
print("== checkpoint saves: 1b, one GPU, seq 4096 x local batch 2, bf16")
print(f"host memory the async run holds for staging: {staged.group(1) if staged else '?'} (page-locked)")
print("sync saves, training stall: " + (", ".join(f"step_{s} {w:.2f} s" for s, w in sync) or "none found"))
later, during = [], set()
for i, (step, stall, written, first, last) in enumerate(writes):
    stall = float(stall)
    first_note = " (the first save: allocates and page-locks the buffer)" if i == 0 else ""
    span = f"steps {first}-{last} ran meanwhile" if first else "written as the run ended"
    print(f"async save step_{step}: training stall {stall:.2f} s{first_note}; written in {float(written):.1f} s; {span}")
    if i > 0:
        later.append(stall)
    if first:  # the write ended after step last-1's poll: steps first..last-1 ran wholly during it
        during.update(range(int(first), int(last)))
if not writes:
    print("async saves: none found")
sync_steps, async_steps = step_times("sync"), step_times("async")
base = median(list(sync_steps.values()))
quiet = median([t for s, t in async_steps.items() if s not in during and s - 1 not in during])
busy = median([t for s, t in async_steps.items() if s in during])
print(f"step time (median), no save in flight: {base:.3f} s (sync run, {len(sync_steps)} steps); "
      f"{quiet:.3f} s (async run, its steps with no write in flight)")
print(f"step time (median), during a background write: {busy:.3f} s ({len(during)} steps)")
print(f"RESULT stall per save: sync {median([w for _, w in sync]):.2f} s, async {median(later):.2f} s "
      f"(saves after the first; target <= 2 s)")
print(f"RESULT speed during a background write: {base / busy:.3f}x the no-save steps of the sync run, "
      f"{quiet / busy:.3f}x the async run's own quiet steps (target >= 0.95)")
EOF
}

for section in "$@"; do
  echo "== $section $(date +%T)"
  "section_$section"
done

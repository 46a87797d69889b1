#!/usr/bin/env bash
# The sections of benchmarks/gpu_verify.sh that measured this directory's results: `fp8_8b_profile` (with PROFILE_S), `ckpt` (with CKPT_BUDGET_S) and `final` (call 5).
# Moved here from gpu_verify.sh as its last version had them; they run with its helpers and settings
# (bench, summarize_train, train_row, profiled_row; the NCCL variables of gpu_env.sh):
#
#   bash benchmarks/results/2026-12-01_h200x1_session2/gpu.sh SECTION...    # SECTION: fp8_8b_profile ckpt final
#
# A record of what ran: a later tree may have renamed the flags they pass.
source "$(dirname "${BASH_SOURCE[0]}")/../../gpu_verify.sh"

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

gpu_verify_main "$@"

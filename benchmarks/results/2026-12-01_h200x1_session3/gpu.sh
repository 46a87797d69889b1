#!/usr/bin/env bash
# The sections of benchmarks/gpu_verify.sh that measured this directory's results: calls 2 and 4 (`offload`, `offload_train`).
# Moved here from gpu_verify.sh as its last version had them; they run with its helpers and settings
# (bench, summarize_train, train_row, profiled_row; the NCCL variables of gpu_env.sh):
#
#   bash benchmarks/results/2026-12-01_h200x1_session3/gpu.sh SECTION...    # SECTION: offload offload_train
#
# A record of what ran: a later tree may have renamed the flags they pass.
source "$(dirname "${BASH_SOURCE[0]}")/../../gpu_verify.sh"

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

gpu_verify_main "$@"

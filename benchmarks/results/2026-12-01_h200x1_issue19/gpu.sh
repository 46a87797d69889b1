#!/usr/bin/env bash
# The sections of benchmarks/gpu_verify.sh that measured this directory's results: calls 2 and 3 (`fp8_8b`; `first_big_run` after `smoke`).
# Moved here from gpu_verify.sh as its last version had them; they run with its helpers and settings
# (bench, summarize_train, train_row, profiled_row; the NCCL variables of gpu_env.sh):
#
#   bash benchmarks/results/2026-12-01_h200x1_issue19/gpu.sh SECTION...    # SECTION: fp8_8b first_big_run
#
# A record of what ran: a later tree may have renamed the flags they pass.
source "$(dirname "${BASH_SOURCE[0]}")/../../gpu_verify.sh"

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

gpu_verify_main "$@"

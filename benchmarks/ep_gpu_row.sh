#!/usr/bin/env bash
# NOT RUN YET: written for the first machine with 8 GPUs lent; its numbers do not exist until then.
#
# A Qwen3-30B-A3B-shaped model (config.json only, random init) on 8 GPUs, in one job: `mfsdp train` at
# --parallel.ep 8, then torchtitan's own trainer with expert_parallel_degree 8, the same sequence length,
# local batch and steps, full activation checkpointing in both (without it `mfsdp plan` predicts 205 GiB
# a GPU at ep 8, 1 x 4096: it does not fit an H200; with it 64 GiB); tok/s per GPU (median over SPAN) and
# peak memory of each, and their ratio (ep_gpu_row.py report).
#
#   bash benchmarks/ep_gpu_row.sh [--dry-run]        # --dry-run: print the commands, run nothing
#
# Run from the repository root with $OUT set (else runs/ep_gpu_row); carried: the torchtitan source at
# TORCHTITAN (default .carry/torchtitan; its commit is recorded) with its test tokenizer and c4_test data.
# Knobs: STEPS (20), SPAN (6..20), SEQ (4096), BATCH (1), TT_CONFIG (torchtitan's qwen3_30b_a3b.toml),
# TT_ARGS (replaces the torchtitan flags below: its CLI changes between versions).
# Not like for like yet: torchtitan's vocabulary is its test tokenizer's (the model's embedding is
# smaller), its data is c4_test; mfsdp's are the real 151,936 and the stdlib corpus. Say so beside numbers.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-$PWD/runs/ep_gpu_row}
TORCHTITAN=${TORCHTITAN:-$PWD/.carry/torchtitan}
STEPS=${STEPS:-20} SPAN=${SPAN:-6..20} SEQ=${SEQ:-4096} BATCH=${BATCH:-1}
TT_CONFIG=${TT_CONFIG:-torchtitan/models/qwen3/train_configs/qwen3_30b_a3b.toml}
HF_DIR=/tmp/qwen3-30b-a3b-shape

MFSDP_CMD=(python3 -m mfsdp.cli train --nproc-per-node 8 --model.hf "$HF_DIR" --parallel.ep 8
  --data.path /tmp/stdlib.tokens --data.seq_len "$SEQ" --data.local_batch "$BATCH" --train.steps "$STEPS"
  --train.sample_tokens 0 --train.checkpoint_every 0 --train.eval_every 0 --train.progress false
  --parallel.activation_checkpointing true --train.out_dir /tmp/ep_row_mfsdp)
read -r -a TT_FLAGS <<< "${TT_ARGS:---job.config_file $TT_CONFIG --model.flavor 30B-A3B \
--model.hf_assets_path tests/assets/tokenizer --training.dataset c4_test --training.local_batch_size $BATCH \
--training.seq_len $SEQ --training.steps $STEPS --parallelism.expert_parallel_degree 8 \
--parallelism.data_parallel_shard_degree 8 --activation_checkpoint.mode full --checkpoint.enable false \
--metrics.enable_wandb false --metrics.log_freq 1 --job.dump_folder /tmp/ep_row_tt}"
TT_CMD=(python3 -m torch.distributed.run --standalone --nproc-per-node 8 -m torchtitan.train "${TT_FLAGS[@]}")
REPORT_CMD=(python3 benchmarks/ep_gpu_row.py report --mfsdp /tmp/ep_row_mfsdp/metrics.jsonl
  --torchtitan "$OUT/torchtitan.log" --span "$SPAN")

if [ "$DRY" = 1 ]; then
  echo "python3 benchmarks/ep_gpu_row.py config $HF_DIR"
  echo "python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens"
  echo "${MFSDP_CMD[*]}"
  echo "(cd $TORCHTITAN && ${TT_CMD[*]})"
  echo "${REPORT_CMD[*]}"
  exit 0
fi

source benchmarks/gpu_env.sh
mkdir -p "$OUT"
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" | tee "$OUT/versions.txt"
git rev-parse HEAD | sed 's/^/mfsdp /' | tee -a "$OUT/versions.txt"
git -C "$TORCHTITAN" rev-parse HEAD 2>/dev/null | sed 's/^/torchtitan /' | tee -a "$OUT/versions.txt"
python3 benchmarks/ep_gpu_row.py config "$HF_DIR"
python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
rm -rf /tmp/ep_row_mfsdp /tmp/ep_row_tt
timeout 280 "${MFSDP_CMD[@]}" > "$OUT/mfsdp.log" 2>&1; echo "mfsdp rc=$?"
cp /tmp/ep_row_mfsdp/metrics.jsonl "$OUT/mfsdp_metrics.jsonl" 2>/dev/null
(cd "$TORCHTITAN" && PYTHONPATH=$TORCHTITAN timeout 280 "${TT_CMD[@]}") > "$OUT/torchtitan.log" 2>&1
echo "torchtitan rc=$?"
"${REPORT_CMD[@]}" | tee "$OUT/ep_gpu_row.md"

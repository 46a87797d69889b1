#!/bin/bash
# LoRA 8B rows in one job: mfsdp train (bf16 base), transformers + PEFT, mfsdp train (float8 base).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
A=(--nproc-per-node 1 --model.preset 8b --peft.method lora --data.local_batch 1 --data.seq_len 4096 --data.microbatches 4
   --train.steps 16 --train.checkpoint_every 0 --train.progress false --train.sample_tokens 0 --train.eval_every 0
   --data.path /tmp/stdlib.tokens)
sumr() { python3 - "$1" <<'PY'
import json, statistics, sys
rows=[json.loads(l) for l in open(sys.argv[1])]
got=[r for r in rows if 7 <= r["step"] <= 16]
print(f"{sys.argv[1]}: median tok/s steps 7-16 {statistics.median(r['tokens_per_s'] for r in got):,.0f}, peak {max(r.get('peak_gib', 0) for r in rows):.2f} GiB, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
PY
}
timeout 230 python3 -m mfsdp.cli train "${A[@]}" --train.out_dir /tmp/lora_bf16 > $OUT/mfsdp_lora_bf16.log 2>&1; echo "mfsdp lora bf16 rc=$? at ${SECONDS}s"
grep -v "^W1\|^\[rank" $OUT/mfsdp_lora_bf16.log | head -12; cp /tmp/lora_bf16/metrics.jsonl $OUT/mfsdp_lora_bf16_metrics.jsonl; sumr $OUT/mfsdp_lora_bf16_metrics.jsonl
timeout 160 python3 benchmarks/peft_lora.py --shape llama3-8b --local-batch 1 --seq 4096 --microbatches 4 --steps 12 --warmup 4 --out $OUT/peft_lora.jsonl > $OUT/peft.log 2>&1; echo "peft rc=$? at ${SECONDS}s"; tail -4 $OUT/peft.log
timeout $((560 - SECONDS)) python3 -m mfsdp.cli train "${A[@]}" --model.float8 tensorwise --train.out_dir /tmp/lora_fp8 > $OUT/mfsdp_lora_fp8.log 2>&1; echo "mfsdp lora fp8 rc=$? at ${SECONDS}s"
grep -v "^W1\|^\[rank" $OUT/mfsdp_lora_fp8.log | head -8; grep -v "^W1" $OUT/mfsdp_lora_fp8.log | tail -4; cp /tmp/lora_fp8/metrics.jsonl $OUT/mfsdp_lora_fp8_metrics.jsonl && sumr $OUT/mfsdp_lora_fp8_metrics.jsonl

#!/bin/bash
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/torchao*.whl 2>/dev/null; export PYTHONPATH=$PWD:/tmp/site
ls mfsdp/runtime/parameter_group.py tests/test_gpu_lora.py >/dev/null && grep -c unsharded_aliases_model mfsdp/runtime/parameter_group.py
python3 -m mfsdp.cli prepare-data stdlib /tmp/stdlib.tokens > /dev/null 2>&1
timeout 150 python3 -m mfsdp.cli train --nproc-per-node 1 --model.preset 8b --peft.method lora --data.local_batch 1 --data.seq_len 4096 --data.microbatches 4 \
  --train.steps 14 --train.checkpoint_every 0 --train.progress false --train.sample_tokens 0 --train.eval_every 0 --data.path /tmp/stdlib.tokens \
  --train.out_dir /tmp/lora_bf16 > $OUT/mfsdp_lora_bf16_alias.log 2>&1; echo "mfsdp lora bf16 rc=$? at ${SECONDS}s"
cp /tmp/lora_bf16/metrics.jsonl $OUT/mfsdp_lora_bf16_alias_metrics.jsonl
python3 - $OUT/mfsdp_lora_bf16_alias_metrics.jsonl <<'PY'
import json, statistics, sys
rows=[json.loads(l) for l in open(sys.argv[1])]; got=[r for r in rows if 6 <= r["step"] <= 14]
print(f"median tok/s steps 6-14 {statistics.median(r['tokens_per_s'] for r in got):,.0f}, peak {max(r['peak_mem_gib'] for r in rows):.2f} GiB, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
PY
timeout $((265 - SECONDS)) python3 -m pytest -q -p no:cacheprovider tests/test_gpu_lora.py 2>&1 | tail -4

#!/usr/bin/env bash
# One device call: the GPU tests at HEAD, then mfsdp before (base) and after (head) the runtime change
# beside FSDP2, 1b and 8b+AC on 2 GPUs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -c "import pytest" 2>/dev/null || { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; }
ROOT=$PWD
(cd .carry/head && PYTHONPATH=$PWD:$PYTHONPATH timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
   tests/test_gpu_conditional.py tests/test_gpu.py 2>&1 | tee $OUT/gpu_tests.log | tail -8)
bench() {  # tree impls preset extra... -> one JSON line per impl
  local tree=$1 impls=$2; shift 2
  (cd .carry/$tree && PYTHONPATH=$PWD:$PYTHONPATH timeout 170 python3 -m torch.distributed.run --standalone \
     --nproc-per-node 2 benchmarks/throughput.py --impl $impls --impl-timeout 150 --out $OUT/bench_$tree.jsonl "$@" \
     > "$OUT/log_${tree}_${impls//,/-}_$2$(echo "$*" | grep -q -- --ac && echo _ac).txt" 2>&1; echo "bench $tree $impls $* rc=$?")
}
bench head fsdp2,mfsdp --preset 1b --local-batch 2 --seq 4096
bench base mfsdp --preset 1b --local-batch 2 --seq 4096
bench head mfsdp --preset 8b --local-batch 1 --seq 4096 --ac
bench base mfsdp --preset 8b --local-batch 1 --seq 4096 --ac
python3 - <<'PY'
import json, os
for f in ("bench_head.jsonl", "bench_base.jsonl"):
    p = os.path.join(os.environ["OUT"], f)
    if os.path.exists(p):
        for line in open(p):
            r = json.loads(line); print(f, {k: r.get(k) for k in ("impl", "preset", "ac", "tokens_per_s_per_gpu", "peak_mem_alloc_gib", "status", "error")})
PY

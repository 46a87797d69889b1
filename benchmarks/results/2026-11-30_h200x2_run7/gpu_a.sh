#!/usr/bin/env bash
# Call A: GPU tests at HEAD, the new CPU tests on this image's torch 2.11, and the 1b A/B of the runtime.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -c "import pytest" 2>/dev/null || { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; }
cd .carry/head && export PYTHONPATH=$PWD:$PYTHONPATH
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_conditional.py tests/test_gpu.py 2>&1 | tee $OUT/gpu_tests.log | tail -4
python3 -c "import torch.distributed as d, inspect; print('sort_ranks' in inspect.signature(d.new_group).parameters)" | sed 's/^/new_group sort_ranks: /'
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_core_uneven.py tests/test_state_dict_bf16.py tests/test_end_of_step.py tests/test_conditional.py -k "not four_ranks" 2>&1 | tee $OUT/cpu_tests_torch211.log | tail -6
cd ../..
bench() { (cd .carry/$1 && PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
  benchmarks/throughput.py --impl $2 --impl-timeout 130 --out $OUT/bench_$1.jsonl --preset 1b --local-batch 2 --seq 4096 \
  > $OUT/log_$1_${2//,/-}.txt 2>&1; echo "bench $1 $2 rc=$?") }
bench head fsdp2,mfsdp
bench base mfsdp
python3 -c "
import json,os
for f in ('bench_head.jsonl','bench_base.jsonl'):
    for l in open(os.path.join(os.environ['OUT'],f)): r=json.loads(l); print(f, r['impl'], r['tokens_per_s_per_gpu'], r['peak_mem_alloc_gib'], r['status'])"

#!/usr/bin/env bash
# Call E: the MoE row (moe-1b, 8 experts top-2, seq 4096) for mfsdp and FSDP2 on 2 GPUs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd .carry/head && export PYTHONPATH=$PWD
timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/throughput.py \
  --preset moe-1b --local-batch 2 --seq 4096 --impl fsdp2,mfsdp --impl-timeout 90 --out $OUT/moe.jsonl \
  > $OUT/moe.txt 2>&1; echo "rc=$?"
grep -E '^\|' $OUT/moe.txt | tail -4

#!/usr/bin/env bash
# Call D: is the resume's late-step difference GPU nondeterminism? Two uninterrupted bf16 1b runs, compared.
# Then the 8b build peak after sharding on meta.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
cd .carry/head && export PYTHONPATH=$PWD
M="python3 -m mfsdp.cli train"
A="--nproc-per-node 2 --model.preset 1b --data.seq_len 2048 --data.local_batch 2 --train.steps 8 --train.checkpoint_every 0 --train.sample_tokens 0 --train.progress false"
timeout 120 $M $A --train.out_dir /tmp/A1 > $OUT/A1.txt 2>&1; echo "A1 exit $?"
timeout 120 $M $A --train.out_dir /tmp/A2 > $OUT/A2.txt 2>&1; echo "A2 exit $?"
python3 - <<'PY' | tee $OUT/repeat_compare.txt
import json
load = lambda d: {r["step"]: r["loss"] for r in map(json.loads, open(d + "/metrics.jsonl"))}
a, b = load("/tmp/A1"), load("/tmp/A2")
print("two uninterrupted runs, steps 1-8:", [(s, a.get(s), b.get(s)) for s in range(1, 9)])
print("identical:", all(a.get(s) == b.get(s) for s in range(1, 9)))
PY
grep -h "built and initialised" $OUT/A1.txt | head -2

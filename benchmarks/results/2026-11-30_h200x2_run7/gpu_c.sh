#!/usr/bin/env bash
# Call C: mfsdp train on 2 H200s: a bad flag, a bf16 1b resume with identical losses, a killed rank,
# and the loop against the benchmark on the same shape.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
cd .carry/head && export PYTHONPATH=$PWD
M="python3 -m mfsdp.cli train"
echo "== bad flag"; $M --nproc-per-node 2 --train.stepz 3 > $OUT/bad_flag.txt 2>&1; echo "exit $?" >> $OUT/bad_flag.txt; cat $OUT/bad_flag.txt
echo "== resume"
A="--nproc-per-node 2 --model.preset 1b --data.seq_len 2048 --data.local_batch 2 --train.steps 8 --train.checkpoint_every 4 --train.sample_tokens 0 --train.progress false"
timeout 150 $M $A --train.out_dir /tmp/A > $OUT/resume_A.txt 2>&1; echo "A exit $?"
cp -r /tmp/A /tmp/B && rm -rf /tmp/B/checkpoints/step_8 && echo step_4 > /tmp/B/checkpoints/latest && head -c 0 /tmp/B/metrics.jsonl
python3 - <<'PY'
import json
rows = [json.loads(l) for l in open("/tmp/B/metrics.jsonl")]
open("/tmp/B/metrics.jsonl", "w").writelines(json.dumps(r) + "\n" for r in rows if r["step"] <= 4)
PY
timeout 150 $M $A --train.out_dir /tmp/B --resume > $OUT/resume_B.txt 2>&1; echo "B exit $?"
python3 - <<'PY' | tee $OUT/resume_compare.txt
import json
load = lambda d: {r["step"]: r["loss"] for r in map(json.loads, open(d + "/metrics.jsonl"))}
a, b = load("/tmp/A"), load("/tmp/B")
print("steps 5-8 uninterrupted vs resumed:", [(s, a.get(s), b.get(s)) for s in range(5, 9)])
print("identical:", all(a.get(s) == b.get(s) for s in range(5, 9)))
PY
echo "== killed rank"
K="--nproc-per-node 2 --model.preset tiny --data.seq_len 256 --data.local_batch 4 --train.steps 400 --train.checkpoint_every 50 --train.sample_tokens 0 --train.progress false --train.out_dir /tmp/K"
$M $K > $OUT/killed.txt 2>&1 & L=$!
for i in $(seq 120); do [ "$(wc -l < /tmp/K/metrics.jsonl 2>/dev/null || echo 0)" -ge 60 ] && break; sleep 0.5; done
R=""; for p in $(pgrep -f "mfsdp.train"); do tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx RANK=1 && R=$p; done
T0=$(date +%s.%N); kill -9 $R; wait $L; rc=$?; T1=$(date +%s.%N)
echo "killed pid $R (rank 1); launcher exit $rc after $(python3 -c "print(round($T1-$T0,1))") s" | tee -a $OUT/killed.txt
sleep 1; pgrep -f mfsdp.train > /dev/null && echo "ORPHANS LEFT" || echo "no orphans"; tail -6 $OUT/killed.txt
echo "== loop vs benchmark"
timeout 150 $M --nproc-per-node 2 --model.preset 1b --data.seq_len 4096 --data.local_batch 2 --train.steps 30 --train.checkpoint_every 0 --train.sample_tokens 0 --train.progress false --train.out_dir /tmp/L > $OUT/loop.txt 2>&1; echo "loop exit $?"
timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/throughput.py --impl mfsdp --preset 1b --local-batch 2 --seq 4096 --out $OUT/bench_loop.jsonl > $OUT/bench_loop.txt 2>&1; echo "bench exit $?"
python3 - <<'PY' | tee $OUT/loop_vs_bench.txt
import json, os, statistics
rows = [json.loads(l) for l in open("/tmp/L/metrics.jsonl")]
loop = statistics.median(r["tokens_per_s_per_gpu"] for r in rows if r["step"] > 10)
bench = json.loads(open(os.path.join(os.environ["OUT"], "bench_loop.jsonl")).readline())["tokens_per_s_per_gpu"]
print(f"mfsdp train median tokens/s/GPU (steps 11-30) {loop:,.0f}; throughput.py {bench:,.0f}; ratio {loop / bench:.3f}")
PY
cp /tmp/A/metrics.jsonl $OUT/resume_A_metrics.jsonl; cp /tmp/B/metrics.jsonl $OUT/resume_B_metrics.jsonl

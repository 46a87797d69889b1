#!/usr/bin/env bash
# The batched GPU benchmark: every implementation on the 1b and 8b+AC configurations, one job,
# the same GPUs. Meant for an H200 machine whose image has torch but not mfsdp or megatron-fsdp.
#
#   bash benchmarks/run_gpu.sh                      # all GPUs, configs "1b 8b_ac"
#   NPROC=1 bash benchmarks/run_gpu.sh              # one GPU
#
# Environment knobs:
#   OUT        where results go (default benchmarks/results): results.jsonl (one JSON line per
#              implementation and config), <date>_<gpu>_<config>.md reports, sysinfo and full logs
#   NPROC      GPUs to use (default: all visible)
#   CONFIGS    any of "1b 8b_ac 8b" (default "1b 8b_ac"); "tiny" is a CPU dry run of this script
#   IMPLS      implementations for 1b (default all five); IMPLS_8B for the 8b configs (default all
#              five on 2+ GPUs; on one GPU, IMPLS without megatron-fsdp, whose 18 B/param of
#              unsharded state cannot fit an 8b model)
#   BUDGET_S   stop starting new configs when fewer than 60 s of this budget remain (default 540)
#   PROFILE=0  skip the profiled step (default on: exposed communication, memory by phase)
#   TRACES=1   keep the chrome traces under $OUT/traces
#   EXTRA      more throughput.py flags, e.g. "--compile", "--grad-reduce-dtype bf16" or
#              "--replicate 2" (HSDP: 2 replica groups, each sharding over NPROC/2 GPUs)
# megatron-fsdp comes from wheels in .whl/ (benchmarks/fetch_wheels.sh; carry .whl to the machine).
set -o pipefail
# Never NVLink multicast / NVLS on the shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export PYTHONPATH=$PWD:$PYTHONPATH  # mfsdp straight from this tree, no install

NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
ALL=mfsdp,fsdp2,megatron-fsdp,megatron-fsdp-exp,none
IMPLS=${IMPLS:-$ALL}
if (( NPROC >= 2 )); then
  IMPLS_8B=${IMPLS_8B:-$ALL}
else
  IMPLS_8B=${IMPLS_8B:-$(tr , '\n' <<< "$IMPLS" | grep -v '^megatron-fsdp' | paste -sd,)}
fi
FLAGS="--out $OUT/results.jsonl --report-dir $OUT $EXTRA"
[[ ${PROFILE:-1} == 1 ]] && FLAGS="$FLAGS --profile"
[[ ${TRACES:-0} == 1 ]] && FLAGS="$FLAGS --trace-dir $OUT/traces"

{
  date -u
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm,power.limit \
    --format=csv
  nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())" 2>&1 | tail -1
  python3 -c "import megatron_fsdp as m; print('megatron_fsdp', m.__version__)" 2>&1 | tail -1
  env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM|CUDA_VISIBLE)' | sort
} > "$OUT/sysinfo.txt" 2>&1
grep -E "^(torch|megatron|[0-9], )" "$OUT/sysinfo.txt"

for cfg in ${CONFIGS:-1b 8b_ac}; do
  case $cfg in
    1b)    args="--preset 1b --local-batch 2 --seq 4096 --impl $IMPLS"; per_impl=150 ;;
    8b_ac) args="--preset 8b --local-batch 1 --seq 4096 --ac --impl $IMPLS_8B"; per_impl=240 ;;
    8b)    args="--preset 8b --local-batch 1 --seq 4096 --impl $IMPLS_8B"; per_impl=240 ;;
    tiny)  args="--preset tiny --local-batch 2 --seq 64 --dtype fp32 --impl $IMPLS"; per_impl=60 ;;
    *)     echo "unknown config $cfg"; continue ;;
  esac
  left=$(( BUDGET_S - ($(date +%s) - T0) ))
  if (( left < 60 )); then echo "SKIP $cfg: ${left}s of the budget left"; continue; fi
  echo "=== $cfg on $NPROC GPU(s), ${left}s left"
  # Full output to the log; on the console only the table (its status column names any error).
  timeout -k 10 "$left" python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    benchmarks/throughput.py $args --impl-timeout $per_impl $FLAGS 2>&1 \
    | tee "$OUT/log_${cfg}_w${NPROC}.txt" \
    | grep -E --line-buffered '^\||report written' | cut -c1-400
  echo "=== $cfg done rc=${PIPESTATUS[0]} at $(( $(date +%s) - T0 ))s"
done

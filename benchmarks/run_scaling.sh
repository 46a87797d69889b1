#!/usr/bin/env bash
# Weak scaling on one host: the same configs at several GPU counts (the first N GPUs each time),
# mfsdp, FSDP2 and megatron-fsdp experimental side by side at every size; optionally HSDP and
# compiled runs at the largest size; then one table (benchmarks/scaling.py).
#
#   SIZES=8 HSDP=2 COMPILE=1 bash benchmarks/run_scaling.sh   # one device call (about 400 s)
#   SIZES="4 2" bash benchmarks/run_scaling.sh                 # the next (about 420 s)
#   SIZES=1 bash benchmarks/run_scaling.sh                     # and the last; same OUT, one table
#
# Environment knobs (the rest pass through to run_gpu.sh: PROFILE, TRACES, EXTRA):
#   OUT       results root (default benchmarks/results/scaling): OUT/w<N>/ per size, OUT/scaling.md
#   SIZES     GPU counts, largest first (default "8 4 2 1"; sizes above the GPUs present are skipped)
#   CONFIGS   run_gpu.sh configs (default "1b 8b_ac 8b"; on 1 GPU "8b" is dropped: it does not fit)
#   IMPLS     default fsdp2,mfsdp,megatron-fsdp-exp (on 1 GPU run_gpu.sh drops megatron-fsdp for 8b:
#             its unsharded state does not fit)
#   HSDP=R    also run 8b at the largest size as HSDP R x (N/R), into OUT/w<N>-hsdp<R>/
#   COMPILE=1 also run 8b compiled (fsdp2, mfsdp) at the largest size, into OUT/w<N>-compile/
#   BUDGET_S  seconds for the whole script (default 570: one device call), shared out by configs
set -o pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
OUT=${OUT:-benchmarks/results/scaling}
BUDGET_S=${BUDGET_S:-570}
IMPLS=${IMPLS:-fsdp2,mfsdp,megatron-fsdp-exp}
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
(( GPUS > 0 )) || { echo "run_scaling.sh: no GPU found (nvidia-smi -L lists none)"; exit 2; }
sizes=()
for n in ${SIZES:-8 4 2 1}; do
  if (( n <= GPUS )); then sizes+=("$n"); else echo "SKIP $n GPUs: only $GPUS here"; fi
done
(( ${#sizes[@]} )) || exit 2
largest=${sizes[0]}
configs_of() {  # the configs that run on N GPUs
  for c in ${CONFIGS:-1b 8b_ac 8b}; do [[ $1 == 1 && $c == 8b ]] || echo "$c"; done
}
configs_left=0  # every run gets the budget left in proportion to its number of configs
for n in "${sizes[@]}"; do configs_left=$((configs_left + $(configs_of "$n" | wc -l))); done
[[ -n $HSDP ]] && configs_left=$((configs_left + 1))
[[ $COMPILE == 1 ]] && configs_left=$((configs_left + 1))

one_run() {  # one_run NAME NPROC CONFIGS VAR=VALUE...: one run_gpu.sh call with its share
  local name=$1 n=$2 cfgs=$3; shift 3
  local count; count=$(wc -w <<< "$cfgs")
  local left=$(( BUDGET_S - ($(date +%s) - T0) ))
  local share=$(( left * count / configs_left ))
  configs_left=$((configs_left - count))
  if (( share < 60 )); then echo "SKIP $name: ${left}s of the budget left"; return; fi
  echo "##### $name: $n GPU(s), ${share}s"
  env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((n - 1)))" NPROC="$n" OUT="$OUT/$name" BUDGET_S="$share" \
    CONFIGS="$cfgs" "$@" bash benchmarks/run_gpu.sh
}

for n in "${sizes[@]}"; do
  impls_8b=$IMPLS; (( n == 1 )) && impls_8b=  # empty: run_gpu.sh's one-GPU default
  one_run "w$n" "$n" "$(configs_of "$n" | xargs)" IMPLS="$IMPLS" IMPLS_8B="$impls_8b"
done
if [[ -n $HSDP ]]; then
  one_run "w$largest-hsdp$HSDP" "$largest" 8b IMPLS_8B="$IMPLS" EXTRA="$EXTRA --replicate $HSDP"
fi
if [[ $COMPILE == 1 ]]; then
  one_run "w$largest-compile" "$largest" 8b IMPLS_8B=fsdp2,mfsdp EXTRA="$EXTRA --compile"
fi

shopt -s nullglob
files=("$OUT"/*/results.jsonl)
(( ${#files[@]} )) && python3 benchmarks/scaling.py "${files[@]}" | tee "$OUT/scaling.md"

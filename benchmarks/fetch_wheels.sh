#!/usr/bin/env bash
# Downloads the wheels the GPU benchmark needs but the H200 image lacks into .whl/
# (git-ignored), so run_gpu.sh can install them offline on the device machine.
#
#   bash benchmarks/fetch_wheels.sh            # megatron-fsdp only
#   EXTRA="einops packaging" bash benchmarks/fetch_wheels.sh   # also pull these deps
#
# megatron-fsdp is pure Python (py3-none-any). Its Requires-Dist are torch, einops and
# packaging; the H200 image already has all three (torch 2.11, einops 0.8.2, packaging 26.x),
# so by default nothing else is fetched and torch is never downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${MEGATRON_FSDP_VERSION:-0.6.1}
PY=${PYTHON:-python3}
mkdir -p .whl
# Target the device image (CPython 3.12, manylinux x86_64), not this machine.
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "megatron-fsdp==${VERSION}" ${EXTRA:-}
ls -l .whl
# Print each wheel's declared requirements so missing deps are visible before a GPU run.
for w in .whl/*.whl; do
  $PY - "$w" <<'PYEOF'
import sys, zipfile
w = sys.argv[1]
with zipfile.ZipFile(w) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    reqs = [l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines()
            if l.startswith("Requires-Dist:")]
print(f"{w}: Requires-Dist: {reqs}")
PYEOF
done

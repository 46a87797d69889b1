# Sourced (from the repository root) by the GPU scripts: the settings the shared H200s need (never
# NVLink multicast / NVLS; deterministic mode wants NVLS off anyway), unbuffered output, and mfsdp
# straight from this tree.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}

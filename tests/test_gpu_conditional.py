"""Conditional computation on CUDA with NCCL: every variant, with injected stream delays (GPU only)."""

from __future__ import annotations

import pytest
import torch

from conditional_models import VARIANTS, cond_parity
from test_conditional import _check

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@requires_cuda
@pytest.mark.parametrize("kind", ["zero3", "zero2", "zero1", "ddp"])
@pytest.mark.parametrize("delay", [False, True])
def test_cuda_every_variant(cuda_world, kind, delay):
    _check(cuda_world.run(cond_parity, timeout=300, variants=VARIANTS, kind=kind, mb=2, pattern="even_ranks",
                          device="cuda", delay=delay)[0])


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: the (replicate, shard) mesh is "
                    "(2, world / 2); runs in the 2-4 GPU issue")
@pytest.mark.parametrize("kind", ["hsdp", "hsdp_deferred", "hfsdp"])
def test_cuda_two_axis_placements(cuda_world, kind):
    """HSDP and HFSDP on a (replicate, shard) mesh of the GPUs at hand: on 2 GPUs that is (2, 1), so
    the replicate axis's collectives run over NCCL; the (2, 2) mesh needs 4 GPUs."""
    _check(cuda_world.run(cond_parity, timeout=300, variants=VARIANTS, kind=kind, mb=2, pattern="sometimes",
                          device="cuda", delay=True)[0])


@requires_cuda
@pytest.mark.parametrize("comm", [dict(double_buffer=True), dict(unify_streams=True), dict(prefetch_depth=2)])
def test_cuda_communication_options(cuda_world, comm):
    _check(cuda_world.run(cond_parity, timeout=300, variants=["nested", "skip_block", "vlm"], kind="zero3", mb=2,
                          pattern="sometimes", steps=4, comm=comm, device="cuda", delay=True)[0])

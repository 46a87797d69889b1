"""The parity cases on CUDA with NCCL, with and without injected delays (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from _dist import World
from test_core_parity import _check, bf16_parity, train_parity

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def cuda_world():
    ws = min(2, torch.cuda.device_count())
    w = World(ws, backend="nccl")
    yield w
    w.close()


@requires_cuda
@pytest.mark.parametrize("kind", ["zero3", "zero2", "zero1", "ddp"])
@pytest.mark.parametrize("delay", [False, True])
def test_cuda_parity(cuda_world, kind, delay):
    _check(cuda_world.run(train_parity, kind=kind, opt="adamw", mb=2, tied=True, ckpt="nonreentrant",
                          device="cuda", delay=delay))
    _check(cuda_world.run(train_parity, kind=kind, opt="sgd", frozen=True, device="cuda", delay=delay))


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("kind", ["hsdp", "hsdp_deferred", "hfsdp", "zero3_2d"])
def test_cuda_parity_2d(kind):
    w = World(4, backend="nccl")
    try:
        _check(w.run(train_parity, kind=kind, opt="sgd", mb=2, device="cuda", delay=True))
    finally:
        w.close()


@requires_cuda
@pytest.mark.parametrize("comm", [{"unify_streams": True}, {"overlap": False}, {"prefetch_depth": 2}])
def test_cuda_communication_options(cuda_world, comm):
    _check(cuda_world.run(train_parity, kind="zero3", opt="adamw", mb=2, device="cuda", delay=True, comm=comm))

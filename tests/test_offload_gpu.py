"""Optimizer offload on CUDA (GPU only): the paths the CPU tests cannot reach (pinned host
buffers, the side stream and its events, copies issued from the worker thread, the copy up's
``weights_ready`` waited by the next gather), against the same run without offload.

Bit-identical where the host's fused CPU AdamW and the GPU's fused AdamW agree to the bit is not
promised (two kernels), so the states and weights are compared to 1e-6 relative; the counts say
whether the speculation was kept (no clip bites) or redone (it bites every step)."""

from __future__ import annotations

import pytest
import torch

from test_offload import CLIP, _compare, overlapped, parity

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
REL = 1e-5


@requires_cuda
@pytest.mark.parametrize("overlap, clip, grads", [("step", 1e6, None), ("step", CLIP, None),
                                                 ("step", 1e6, torch.bfloat16), ("copy", CLIP, torch.bfloat16),
                                                 ("none", CLIP, None)])
def test_cuda_offload_parity(cuda_world, overlap, clip, grads):
    (plain, offloaded), _, counts = cuda_world.run(parity, kind="zero3", opt="fused", fraction=0.5, overlap=overlap,
                                                   clip=clip, device="cuda", grads=grads)[0]
    for got, want in zip(offloaded, plain):
        _compare(got, want, REL)
    kept = 6 if overlap == "step" and clip > 1 else 0
    assert counts["kept"] == kept and counts["serialized"] == 6 - kept, counts


@requires_cuda
def test_cuda_early_hook_is_caught_and_skip_leaves_no_trace(cuda_world):
    (want, got), counts = cuda_world.run(overlapped, clip=1e6, early=True, device="cuda", delay=False)[0]
    for a, b in zip(got, want):
        _compare(a, b, REL)
    assert counts["redone"] == 12 and counts["kept"] == 0, counts  # dropped ones counted in (test_offload._counts)
    (want, got), counts = cuda_world.run(overlapped, clip=1e6, skip=1, steps=4, device="cuda", delay=False)[0]
    for a, b in zip(got, want):
        _compare(a, b, REL)
    assert counts == {"kept": 12, "redone": 4, "serialized": 0}, counts

"""Optimizer offload on CUDA (GPU only): the paths the CPU tests cannot reach (pinned host
buffers, the side stream and its events, copies issued from the worker thread, the copy up's
``weights_ready`` waited by the next gather).

Two references, for two different questions:

* the same offload serialized (``overlap="none"``: every copy and CPU step in ``step()``, after
  backward). It runs the same host kernel on the same gradients, so the overlapped run must equal
  it bit for bit: a copy that raced its reduction, a CPU step that read its staging buffer early,
  or a forward that read weights before their copy up landed, each changes bits;
* no offload, the device's fused AdamW. The host's fused CPU AdamW and the GPU's do not agree to
  the bit (two kernels), and with bf16 compute a one-ulp difference in a master weight can flip
  its bf16 rounding, so after three steps the states differ by up to about 1.3e-5 of their largest
  value (measured on one H200). The bound is 1e-4: a gradient or an update that is wrong by one
  microbatch or one step (lr 1e-2) is off by 1e-2 or more.

The counts say whether the speculation was kept (no clip bites) or redone (it bites every step)."""

from __future__ import annotations

import pytest
import torch

import mfsdp
from test_offload import CLIP, _build, _compare, _counts, _snapshot, _step, overlapped
from mfsdp import offload as offload_mod

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
REL = 1e-4  # against the device's AdamW (see the module's notes)
SERIALIZED = mfsdp.OffloadPolicy(fraction=0.5, overlap="none")


def three_ways(rank, ws, overlap, clip, grads, steps=3, device="cuda"):
    """No offload, half the units offloaded with ``overlap``, and the same serialized."""
    out, counts = [], None
    for offload in (None, mfsdp.OffloadPolicy(fraction=0.5, overlap=overlap), SERIALIZED):
        model, optim = _build(rank, ws, "zero3", "fused", offload, device=device, grads=grads)
        for step in range(steps):
            _step(model, optim, step, rank, ws, clip=clip)
        out.append(_snapshot(model, optim))
        if counts is None and offload is not None:
            counts = _counts(offload_mod.offload_of(optim))
    return out, counts


@requires_cuda
@pytest.mark.parametrize("overlap, clip, grads", [("step", 1e6, None), ("step", CLIP, None),
                                                 ("step", 1e6, torch.bfloat16), ("copy", CLIP, torch.bfloat16),
                                                 ("none", CLIP, None)])
def test_cuda_offload_parity(cuda_world, overlap, clip, grads):
    (plain, offloaded, serialized), counts = cuda_world.run(three_ways, overlap=overlap, clip=clip, grads=grads)[0]
    for got, want in zip(offloaded, serialized):
        _compare(got, want, 0)
    for got, want in zip(offloaded, plain):
        _compare(got, want, REL)
    kept = 6 if overlap == "step" and clip > 1 else 0
    assert counts["kept"] == kept and counts["serialized"] == 6 - kept, counts


@requires_cuda
def test_cuda_early_hook_is_caught_and_skip_leaves_no_trace(cuda_world):
    every_unit = mfsdp.OffloadPolicy(overlap="none")
    (want, got), counts = cuda_world.run(overlapped, clip=1e6, early=True, device="cuda", delay=False,
                                         reference=every_unit)[0]
    for a, b in zip(got, want):
        _compare(a, b, 0)
    assert counts["redone"] == 4 and counts["kept"] == 0, counts  # the first step only; dropped ones counted in
    (want, got), counts = cuda_world.run(overlapped, clip=1e6, skip=1, steps=4, device="cuda", delay=False,
                                         reference=every_unit)[0]
    for a, b in zip(got, want):
        _compare(a, b, 0)
    assert counts == {"kept": 12, "redone": 4, "serialized": 0}, counts

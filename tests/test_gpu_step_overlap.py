"""The optimizer step's early gathers on CUDA with NCCL: parity under stream stalls, and the gathers
of the next forward's first modules running beside the update of the rest (GPU only)."""

from __future__ import annotations

import pytest
import torch

from test_step_overlap import FP32_TOL, staged_training

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@requires_cuda
@pytest.mark.parametrize("kind", ["zero3", "zero2"])
@pytest.mark.parametrize("opt", ["adamw", "fused"])
def test_cuda_staged_step_parity(cuda_world, kind, opt):
    err, params, gathered, _, out_err = cuda_world.run(staged_training, kind=kind, opt=opt, device="cuda",
                                                       delay=True)[0]
    one_call = cuda_world.run(staged_training, kind=kind, opt=opt, device="cuda", variant="off")[0][1]
    assert err < FP32_TOL and out_err < 1e-5, (err, out_err)
    assert all(params[k].equal(one_call[k]) for k in params)
    if kind == "zero3":
        assert gathered[-1][:2] == [True, True], gathered


def step_gather_overlap(rank, ws, across):
    """One profiled ``optimizer.step()`` of a bf16 model with fp32 main weights (ZeRO-3): the
    fraction of the side streams' kernel time that runs while the compute stream runs a kernel,
    and how many side-stream kernels the step launched."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    import mfsdp
    from mfsdp import _compat
    from models import Net, make_mesh, make_placements, shard_net

    torch.manual_seed(0)
    net = Net(vocab=32768, dim=2048, hidden=8192, n_blocks=6).cuda().to(torch.bfloat16)
    shard_net(net, make_mesh("zero3", ws, "cuda"), make_placements("zero3"),
              policy=mfsdp.MixedPrecisionPolicy(main_grads_dtype=torch.float32),
              comm=mfsdp.CommunicationPolicy(prefetch_across_step=across))
    inner = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=True)
    # The compute stream stalls before the update (about 20 ms, longer than the host takes to queue
    # the whole step), so what is measured is whether the schedule lets the gathers run beside the
    # update, not whether the host happened to queue them before the GPU had finished it: launched
    # at the host's pace, the update of these few large groups can end before the gathers are queued
    # (0.0 hidden in a loaded suite, 0.32 alone).
    inner.register_step_pre_hook(lambda *_: _compat.gpu_spin(40_000_000))
    opt = mfsdp.fully_shard_optimizer(net, inner)
    x = torch.randint(0, 32768, (4, 512), device="cuda")
    for _ in range(2):
        net(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    net(x).float().pow(2).mean().backward()
    torch.cuda.synchronize()
    torch.distributed.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    kernels = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy")]
    by_stream: dict = {}
    for e in kernels:
        by_stream.setdefault(e["args"]["stream"], []).append((e["ts"], e["ts"] + e["dur"]))
    compute = max(by_stream, key=lambda s: sum(b - a for a, b in by_stream[s]))
    busy = sorted(by_stream.pop(compute))
    side = [iv for ivs in by_stream.values() for iv in ivs]
    total = sum(b - a for a, b in side)
    covered = sum(max(0.0, min(b, d) - max(a, c)) for a, b in side for c, d in busy if c < b and d > a)
    return {"side_kernels": len(side), "hidden": covered / total if total else None}


# Lower bounds on the hidden fraction of the step's early gathers, by GPU count: on 2 GPUs NCCL
# gathers beside the update (run 7); on 1 GPU the "gathers" are casts into the unsharded buffers,
# short kernels that the fused update leaves fewer gaps beside: 0.33 measured at 89acf2b (issue 19).
STEP_HIDDEN_BOUND = {1: 0.2, 2: 0.5}


@requires_cuda
def test_step_gathers_run_beside_the_update(cuda_world):
    """With ``prefetch_across_step`` the step launches the first modules' gathers (root and first
    block), and most of their time runs beside the update of the other blocks; without it the step
    launches none."""
    on = cuda_world.run(step_gather_overlap, across=True)[0]
    off = cuda_world.run(step_gather_overlap, across=False)[0]
    print("step overlap:", on, off)
    assert off["side_kernels"] == 0, off
    assert on["side_kernels"] > 0 and on["hidden"] > STEP_HIDDEN_BOUND[min(cuda_world.world_size, 2)], on

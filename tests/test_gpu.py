"""The parity cases on CUDA with NCCL, with and without injected delays (skipped without a GPU)."""

from __future__ import annotations

import gc

import pytest
import torch

from _dist import World
from test_core_parity import _check, train_parity

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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
        _check(w.run(train_parity, kind=kind, opt="sgd", mb=3, device="cuda", delay=True))
    finally:
        w.close()


@requires_cuda
@pytest.mark.parametrize("comm", [{"unify_streams": True}, {"overlap": False}, {"prefetch_depth": 2},
                                  {"double_buffer": True}, {"double_buffer": True, "prefetch_depth": 2},
                                  {"keep_gathered": True}, {"keep_gathered": True, "double_buffer": True}])
def test_cuda_communication_options(cuda_world, comm):
    _check(cuda_world.run(train_parity, kind="zero3", opt="adamw", mb=2, device="cuda", delay=True, comm=comm))


def overlap_fraction(rank, ws):
    """Fractions of side-stream kernel time (all of it, the all-gathers', the reduce-scatters')
    that run while the compute stream runs a kernel, over one profiled ZeRO-3 step of a bf16 model."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    import mfsdp
    from models import Net, make_mesh, make_placements, shard_net

    torch.manual_seed(0)
    net = Net(vocab=4096, dim=2048, hidden=8192, n_blocks=6).cuda().to(torch.bfloat16)
    shard_net(net, make_mesh("zero3", ws, "cuda"), make_placements("zero3"),
              policy=mfsdp.MixedPrecisionPolicy(main_grads_dtype=torch.float32))
    # 32k tokens: about 5 ms of forward per block, so the GPU, not the host's hooks, sets the pace
    # (with short kernels the compute stream idles between launches and nothing can hide).
    x = torch.randint(0, 4096, (16, 2048), device="cuda")
    for _ in range(2):
        net(x).float().pow(2).mean().backward()
    torch.cuda.synchronize()
    torch.distributed.barrier()  # a rank that starts late would show as the other's gathers waiting
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        net(x).float().pow(2).mean().backward()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    kernels = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
    by_stream: dict = {}
    for e in kernels:
        by_stream.setdefault(e["args"]["stream"], []).append((e["ts"], e["ts"] + e["dur"]))
    compute = max(by_stream, key=lambda s: sum(b - a for a, b in by_stream[s]))
    busy = sorted(by_stream.pop(compute))
    names = {(e["ts"], e["ts"] + e["dur"]): e["name"] for e in kernels}

    def hidden(intervals):
        total = sum(b - a for a, b in intervals)
        covered = sum(max(0.0, min(b, d) - max(a, c)) for a, b in intervals for c, d in busy if c < b and d > a)
        return covered / total if total else None

    side = [iv for ivs in by_stream.values() for iv in ivs]
    gathers = [iv for iv in side if "AllGather" in names[iv]]
    reductions = [iv for iv in side if "ReduceScatter" in names[iv]]
    return {"side": hidden(side), "streams": len(by_stream),
            "all_gather": hidden(gathers), "reduce_scatter": hidden(reductions),
            "kernels": (len(gathers), len(reductions))}


# Lower bounds on the hidden fraction of all side-stream kernel time, by GPU count. 2 GPUs: run 7
# measured 0.77-0.95 over NCCL. 1 GPU: no NCCL kernels, only the side streams' short casts and
# copies, which the first module of each direction has nothing to hide behind: 0.42 measured at
# 89acf2b (issue 19).
SIDE_HIDDEN_BOUND = {1: 0.3, 2: 0.5}


@requires_cuda
def test_communication_overlaps_compute(cuda_world):
    """Gathers overlap the forward and backward compute of the module before them, reductions the
    backward of the module after them. (With one rank there are no NCCL kernels, only side-stream
    copies; then only the side streams are checked.)"""
    out = cuda_world.run(overlap_fraction)[0]
    print("hidden fractions:", out)
    assert out["streams"] >= 1
    assert out["side"] > SIDE_HIDDEN_BOUND[min(cuda_world.world_size, 2)], out
    if cuda_world.world_size > 1:
        # Measured on 2 H200s: gathers 0.77-0.82 hidden (the step's first ones have no compute to
        # hide behind), reductions 0.94-0.95 (all but the root's last one).
        assert out["all_gather"] > 0.5 and out["reduce_scatter"] > 0.5, out


def registered_buffers_match_default(rank, ws, comm):
    """Gathers through NCCL-registered persistent buffers (use_symm_mem) give bit-identical training
    to the default path: a gather only copies, so any difference is a bug, not rounding."""
    import mfsdp
    from models import Net, global_batch, loss_fn, make_mesh, make_placements, reference_copy, shard_net

    torch.manual_seed(0)
    nets = [Net(vocab=64, dim=32, hidden=64, n_blocks=4).cuda()]
    nets.append(reference_copy(nets[0]))
    mesh, placements = make_mesh("zero3", ws, "cuda"), make_placements("zero3")
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    options = [dict(), dict(use_symm_mem=True, comm=mfsdp.CommunicationPolicy(**comm))]
    for net, opts in zip(nets, options):
        net.to(torch.bfloat16)
        shard_net(net, mesh, placements, policy, **opts)
    optims = [torch.optim.AdamW(n.parameters(), lr=1e-2) for n in nets]
    losses = []
    for step in range(3):
        x, y = global_batch(step, 8, 16, 64, "cuda")
        x, y = x.chunk(ws)[rank], y.chunk(ws)[rank]
        pair = []
        for net, opt in zip(nets, optims):
            loss = loss_fn(net(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(float(loss))
        losses.append(pair)
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(nets[0].parameters(), nets[1].parameters()))
    slots = nets[1].context.gather_slots
    return losses, same, len(slots.slots), slots._pool is not None


@requires_cuda
@pytest.mark.parametrize("comm", [{"double_buffer": True}, {"double_buffer": True, "prefetch_depth": 2}])
def test_symm_mem_buffers_match_default(cuda_world, comm):
    losses, same, n_slots, pooled = cuda_world.run(registered_buffers_match_default, comm=comm)[0]
    assert all(a == b for a, b in losses), losses
    assert same
    assert n_slots == comm.get("prefetch_depth", 1) + 1
    assert pooled or torch.cuda.device_count() == 1, "registered slots come from an NCCL memory pool"


def manager_nccl_ub_matches_default(rank, ws):
    """The manager's fsdp_double_buffer + nccl_ub on a Hugging Face Llama: bit-identical losses."""
    import copy

    from test_manager_models import batch, make_hf

    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh

    base = make_hf("llama", vocab=64, layers=4).cuda()
    mesh = build_device_mesh("cuda")
    runs = []
    for flags in ({}, {"fsdp_double_buffer": True, "nccl_ub": True}):
        model, _ = MegatronFSDPManager(MegatronFSDPConfig(**flags), mesh).parallelize(copy.deepcopy(base))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            x = batch(step, size=2 * ws, vocab=64).cuda().chunk(ws)[rank]
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        runs.append(losses)
    return runs


@requires_cuda
def test_manager_nccl_ub_matches_default(cuda_world):
    default, registered = cuda_world.run(manager_nccl_ub_matches_default)[0]
    assert default == registered, (default, registered)


def memory_against_analytic_and_fsdp2(rank, ws):
    """Resting memory of a bf16-compute, fp32-master ZeRO-3 model with AdamW against the analytic
    sharded size, and the peak of a training step against torch's FSDP2 on the same model."""
    import mfsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from models import Net, global_batch, loss_fn, make_mesh, make_placements, reference_copy, shard_net

    mesh, placements = make_mesh("zero3", ws, "cuda"), make_placements("zero3")
    # Set-up that stays allocated, before measuring: the communicator, and cuBLAS's workspaces
    # (one per handle: the forward thread's and autograd's), which come from the caching allocator.
    torch.distributed.all_reduce(torch.ones(1, device="cuda"))
    warm = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    (warm @ warm).float().sum().backward()
    del warm
    x, y = global_batch(0, 8, 512, 4096, "cuda")
    x, y = x.chunk(ws)[rank], y.chunk(ws)[rank]

    def steps(net, opt, zero_grad_to_none):
        torch.cuda.synchronize()
        for _ in range(3):
            torch.cuda.reset_peak_memory_stats()
            loss_fn(net(x).float(), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=zero_grad_to_none)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    torch.manual_seed(0)
    template = Net(vocab=4096, dim=1024, hidden=4096, n_blocks=6)
    out = {}
    # mfsdp: the model is built in bf16; its storage is handed to mfsdp's buffers.
    base = torch.cuda.memory_allocated()
    net = reference_copy(template).cuda().to(torch.bfloat16)
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    shard_net(net, mesh, placements, policy)
    opt = mfsdp.fully_shard_optimizer(net, torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True))
    peak = steps(net, opt, zero_grad_to_none=False)  # gradients stay: they are part of the resting set
    shard = sum(p.to_local().numel() for p in net.parameters())
    analytic = shard * (4 + 4 + 8)  # fp32 main weights, fp32 gradients, two fp32 AdamW moments
    # The step gathered the next forward's first modules (prefetch_across_step): not resting state.
    early = [m for m in net.modules() if isinstance(m, mfsdp.FsdpModule) and m.is_unsharded()]
    held = sum(g.unsharded.tensor.untyped_storage().nbytes() for m in early for g in m.parameter_groups
               if g.unsharded is not g.main and g.unsharded.is_allocated)
    out["early_modules"] = [m.name for m in early]
    out["mfsdp_resting"], out["analytic"] = torch.cuda.memory_allocated() - base - held, analytic
    out["mfsdp_peak"] = peak - base
    blocks = [sum(p.numel() for p in block.parameters()) for block in net.blocks]
    root = sum(p.numel() for p in net.parameters()) - sum(blocks)  # embedding, norm and head
    out["largest_unit_params"] = max(blocks + [root])
    del net, opt
    gc.collect()  # mfsdp's model has reference cycles: free it now, not during FSDP2's measured steps
    torch.cuda.empty_cache()
    # Activations: what the unsharded bf16 model's step holds beyond its weights, on the same batch
    # (it includes whatever bf16 gradients exist at that peak, so it errs on the generous side).
    base = torch.cuda.memory_allocated()
    plain = reference_copy(template).cuda().to(torch.bfloat16)
    weights = torch.cuda.memory_allocated() - base
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss_fn(plain(x).float(), y).backward()
    torch.cuda.synchronize()
    out["activations"] = torch.cuda.max_memory_allocated() - base - weights
    del plain
    torch.cuda.empty_cache()
    # FSDP2: fp32 shards, bf16 all-gathers, fp32 reduce-scatters, the same blocks.
    base = torch.cuda.memory_allocated()
    ref = reference_copy(template).cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in list(ref.blocks) + [ref]:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=True)
    out["fsdp2_peak"] = steps(ref, opt, zero_grad_to_none=False) - base
    return out


@requires_cuda
def test_memory_resting_analytic_and_peak_near_fsdp2(cuda_world):
    out = cuda_world.run(memory_against_analytic_and_fsdp2)[0]
    print("memory bytes:", out)
    assert abs(out["mfsdp_resting"] - out["analytic"]) <= 0.01 * out["analytic"], out
    assert out["early_modules"] == ["", "blocks.0"], out  # the root and the first block, held from the step
    # Measured on 2 H200s: resting 470.05 MB for 470.02 analytic; peak 776.3 MB against FSDP2's
    # 759.5 (+2.2 %) on this small model, while on the 1b and 8b presets mfsdp's peak is 1-3 %
    # below FSDP2's (benchmarks/results). The bound guards against regressions of either.
    assert out["mfsdp_peak"] <= 1.03 * out["fsdp2_peak"], out
    # Beyond the sharded states and the activations, at most two unsharded units in flight: per
    # parameter, bf16 weights (2 bytes), bf16 gradients (2) and the fp32 reduction input (4).
    in_flight = 2 * out["largest_unit_params"] * (2 + 2 + 4)
    assert out["mfsdp_peak"] <= out["mfsdp_resting"] + out["activations"] + in_flight, out


def stream_priorities(rank, ws):
    """(all-gather, reduce-scatter) stream priorities of a CUDA tree with ``high_priority_streams``
    and without (the default)."""
    import mfsdp
    from models import Net, global_batch, loss_fn, make_mesh, make_placements, shard_net

    out = []
    for high in (True, False):
        net = shard_net(Net().cuda(), make_mesh("zero3", ws, "cuda"), make_placements("zero3"),
                        comm=mfsdp.CommunicationPolicy(high_priority_streams=high))
        x, y = global_batch(0, 2 * ws, 5, 13, device="cuda")
        loss_fn(net(x.chunk(ws)[rank]), y.chunk(ws)[rank]).backward()
        ctx = net._context
        out.append((ctx.allgather_stream.priority, ctx.reduce_scatter_stream.priority,
                    torch.cuda.Stream(priority=-1).priority))
    return out


@requires_cuda
def test_side_streams_run_at_high_priority_when_asked(cuda_world):
    (high_ag, high_rs, highest), (low_ag, low_rs, _) = cuda_world.run(stream_priorities)[0]
    assert high_ag == high_rs == highest < 0
    assert low_ag == low_rs == 0

"""Behaviour of the core beyond parity: errors, memory and phases, collective counts, unused
parameters, state dicts and clipping. CPU, gloo, one world of 2 ranks."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mfsdp
from mfsdp.runtime import collectives
from models import Block, Net, global_batch, step_both, loss_fn, make_mesh, make_placements, reference_copy, shard_net


def _expect(exc_type, fn, *words):
    try:
        fn()
    except exc_type as exc:
        message = str(exc)
        assert all(w in message for w in words), message
        return message
    raise AssertionError(f"expected {exc_type.__name__}")


def bad_inputs(rank, ws):
    mesh = make_mesh("zero3", ws)
    block = mfsdp.fully_shard(Block(6, 10), mesh)
    _expect(ValueError, lambda: mfsdp.fully_shard(block, mesh), "already applied")
    _expect(ValueError, lambda: mfsdp.fully_shard(Block(6, 10), mesh, mfsdp.Placements.zero3("nope")), "unknown mesh axis")
    # child sharded after its parent
    net = Net()
    mfsdp.fully_shard(net, mesh)
    _expect(ValueError, lambda: mfsdp.fully_shard(net.blocks[0], mesh), "bottom-up")
    # parameter shared across FSDP modules that do not own it together
    net = Net()
    net.blocks[1].w1.weight = net.blocks[0].w1.weight
    mfsdp.fully_shard(net.blocks[0], mesh)
    _expect(ValueError, lambda: mfsdp.fully_shard(net.blocks[1], mesh), "shared across FSDP modules")
    # ... and one re-tied after wrapping is caught at the first forward
    net = shard_net(Net(), mesh, mfsdp.Placements.zero3("dp"))
    net.blocks[1].w2.weight = net.blocks[0].w2.weight
    _expect(ValueError, lambda: net(torch.zeros(1, 3, dtype=torch.long)), "shared with FSDP module")
    # a forward of a non-root module before its root ever ran
    net = shard_net(Net(), mesh, mfsdp.Placements.zero3("dp"))
    _expect(RuntimeError, lambda: net.blocks[0](torch.zeros(1, 3, 6)), "before its FSDP root")
    # unsupported dtype
    _expect(NotImplementedError, lambda: mfsdp.fully_shard(Block(6, 10).half(), mesh), "float16")
    _expect(NotImplementedError, lambda: mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float16), "fp16")
    # an extra mesh axis that is not data-parallel
    mesh_2d = torch.distributed.device_mesh.init_device_mesh("cpu", (1, ws), mesh_dim_names=("tp", "dp"))
    _expect(ValueError, lambda: mfsdp.fully_shard(Block(6, 10), mesh_2d, mfsdp.Placements.zero3("dp")), "tp")
    # load_state_dict(assign=True) would replace the shards
    net = shard_net(Net(), mesh, mfsdp.Placements.zero3("dp"))
    sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    _expect(RuntimeError, lambda: net.load_state_dict(sd, assign=True), "assign")
    return True


def test_bad_inputs(world):
    world(2).run(bad_inputs)


def test_placements_validation():
    from torch.distributed.tensor import Partial, Replicate, Shard

    with pytest.raises(ValueError, match="one placement per"):
        mfsdp.Placements(("dp",), [Shard(0), Shard(0)], [Shard(0)], [Shard(0)])
    with pytest.raises(NotImplementedError, match="unsupported placement combination"):
        mfsdp.Placements(("dp",), [Shard(0)], [Replicate()], [Shard(0)])
    with pytest.raises(NotImplementedError, match="Shard\\(1\\)"):
        mfsdp.Placements(("dp",), [Shard(1)], [Shard(1)], [Shard(1)])
    with pytest.raises(NotImplementedError, match="Partial"):
        mfsdp.Placements(("dp",), [Partial()], [Partial()], [Shard(0)])
    assert mfsdp.Placements.zero1("dp").name == "ZeRO-1"
    assert mfsdp.Placements.hfsdp("r", "s").shard_order == (1, 0)
    assert mfsdp.Placements.hsdp("r", "s", defer_replicate_reduction=True).deferred_all_reduce == (0,)


def test_flat_layout_is_torch_chunk():
    from mfsdp.runtime.flat_buffer import FlatLayout

    layout = FlatLayout([torch.Size((10, 3)), torch.Size((3,))], num_shards=4)
    full = [torch.arange(30.).view(10, 3), torch.arange(3.)]
    for k in range(4):
        want = [t.chunk(4)[k] if k < len(t.chunk(4)) else t[:0] for t in full]
        got_rows = [m.rows_of_shard(k) for m in layout.members]
        assert got_rows == [w.shape[0] for w in want]


def memory_and_phases(rank, ws):
    torch.manual_seed(0)
    net = Net(vocab=64, dim=32, hidden=64, n_blocks=3)
    total = sum(p.numel() for p in net.parameters())
    shard_net(net, make_mesh("zero3", ws), make_placements("zero3"))
    resting = sum(g.model.tensor.untyped_storage().size() for m in net.modules() if isinstance(m, mfsdp.FsdpModule)
                  for g in m.parameter_groups) // 4
    allocated = []

    def spy(module, args):
        allocated.append(sum(g.unsharded.is_allocated and g.unsharded is not g.model
                             for b in net.blocks for g in b.parameter_groups))

    for b in net.blocks:
        b.register_forward_pre_hook(spy)
    x, y = global_batch(0, 4, 5, 64)
    loss_fn(net(x), y).backward()
    after_backward = [g.unsharded.is_allocated for m in net.modules() if isinstance(m, mfsdp.FsdpModule)
                      for g in m.parameter_groups]
    with torch.no_grad():
        net(x)
    after_no_grad = [g.unsharded.is_allocated for m in net.modules() if isinstance(m, mfsdp.FsdpModule)
                     for g in m.parameter_groups]
    phases = {m.phase for m in net.modules() if isinstance(m, mfsdp.FsdpModule)}
    return resting, total, allocated, after_backward, after_no_grad, phases, net.is_root(), net.blocks[0].is_root()


def test_memory_and_phases(world):
    resting, total, allocated, after_backward, after_no_grad, phases, root_is_root, block_is_root = \
        world(2).run(memory_and_phases)[0]
    padding = 4 * 64  # at most a row per parameter and rank
    assert resting <= total / 2 + padding, (resting, total)
    assert max(allocated) <= 2, allocated  # this block and the prefetched next one
    assert not any(after_backward) and not any(after_no_grad)
    assert phases == {mfsdp.ModulePhase.IDLE}
    assert root_is_root and not block_is_root


def collective_counts(rank, ws, kind, mb):
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    originals = {name: getattr(collectives, name) for name in counts}

    def counting(name):
        def fn(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return fn

    torch.manual_seed(0)
    net = Net(n_blocks=3)
    shard_net(net, make_mesh(kind, ws), make_placements(kind))
    optim = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = global_batch(0, 4 * ws, 5, 13)
    net(x[:1]).sum().backward()  # warm-up step, then count one step
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        net(x[:1])  # consumes the warm-up step's weight refresh
    for name in counts:
        setattr(collectives, name, counting(name))
    try:
        for i, (mx, my) in enumerate(zip(x.chunk(mb), y.chunk(mb))):
            with mfsdp.microbatch(net, is_last=i == mb - 1):
                loss_fn(net(mx), my).backward()
        optim.step()
        net(x[:1])
    finally:
        for name, fn in originals.items():
            setattr(collectives, name, fn)
    return counts


def cast_gather(rank, ws, coalesce):
    """fp32 shards gathered into bf16 outputs: cast into this rank's block, then gathered in place."""
    sizes = [3, 5, 1]
    inputs = [torch.randn(n, generator=torch.Generator().manual_seed(10 * rank + i)) for i, n in enumerate(sizes)]
    outputs = [torch.full((ws * n,), float("nan"), dtype=torch.bfloat16) for n in sizes]
    collectives.all_gather(outputs, inputs, dist.group.WORLD, coalesce=coalesce)
    expected = [torch.cat([torch.randn(n, generator=torch.Generator().manual_seed(10 * r + i))
                           for r in range(ws)]).bfloat16() for i, n in enumerate(sizes)]
    return all(torch.equal(o, e) for o, e in zip(outputs, expected))


@pytest.mark.parametrize("coalesce", [True, False])
def test_all_gather_casts_in_place(world, coalesce):
    assert all(world(2).run(cast_gather, coalesce=coalesce))


def scatter_blocks(rank, ws):
    """reduce_scatter averages each input over the ranks and keeps this rank's block (on gloo, via
    one all-reduce of the inputs laid end to end)."""
    sizes = [3, 5, 1]
    make = lambda r: [torch.randn(ws * n, generator=torch.Generator().manual_seed(10 * r + i))  # noqa: E731
                      for i, n in enumerate(sizes)]
    outputs = [torch.full((n,), float("nan")) for n in sizes]
    collectives.reduce_scatter(outputs, make(rank), dist.group.WORLD)
    mean = [sum(ins) / ws for ins in zip(*[make(r) for r in range(ws)])]
    expected = [m[rank * n:(rank + 1) * n] for m, n in zip(mean, sizes)]
    return max(float((o - e).abs().max()) for o, e in zip(outputs, expected))


def test_reduce_scatter_keeps_the_average_of_its_block(world):
    assert max(world(2).run(scatter_blocks)) < 1e-6


@pytest.mark.parametrize("kind,mb,expected", [
    # 4 modules (3 blocks + root). ZeRO-3: a gather per module per forward and per backward, less the
    # root's re-gather; one reduce-scatter per module per backward; + the next step's forward.
    ("zero3", 1, {"all_gather": 4 + 3 + 4, "reduce_scatter": 4, "all_reduce": 0}),
    ("zero3", 2, {"all_gather": 2 * (4 + 3) + 4, "reduce_scatter": 2 * 4, "all_reduce": 0}),
    # ZeRO-2: reduce-scatter per microbatch, one all-gather per step (refresh after the step).
    ("zero2", 2, {"all_gather": 4, "reduce_scatter": 2 * 4, "all_reduce": 0}),
    # ZeRO-1: one reduce-scatter and one all-gather per step.
    ("zero1", 2, {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 0}),
    # DDP: one all-reduce per module per step.
    ("ddp", 2, {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 4}),
])
def test_collective_counts(world, kind, mb, expected):
    assert world(2).run(collective_counts, kind=kind, mb=mb)[0] == expected


class _Routed(nn.Module):
    """Two experts; rank 0's data goes to expert a, rank 1's to expert b; `never` is never used."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.never = nn.Linear(6, 6)

    def forward(self, x):
        return x + (self.a(x) if self.route == 0 else self.b(x))


def unused_parameters(rank, ws):
    torch.manual_seed(0)
    net = Net(n_blocks=2)
    net.blocks[0] = _Routed()
    ref = reference_copy(net)
    shard_net(net, make_mesh("zero3", ws), make_placements("zero3"))
    x, y = global_batch(0, 4, 5, 13)
    for r in range(ws):
        ref.blocks[0].route = r
        loss_fn(ref(x.chunk(ws)[r]), y.chunk(ws)[r]).div(ws).backward()
    net.blocks[0].route = rank
    loss_fn(net(x.chunk(ws)[rank]), y.chunk(ws)[rank]).backward()
    ref_grads = dict(ref.named_parameters())
    errors = {}
    for name, p in net.named_parameters():
        if p.grad is None:
            errors[name] = None if ref_grads[name].grad is None else "missing"
            continue
        errors[name] = float((p.grad.full_tensor() - ref_grads[name].grad).abs().max())
    return errors


def test_unused_parameters(world):
    errors = world(2).run(unused_parameters)[0]
    assert errors["blocks.0.never.weight"] is None and errors["blocks.0.never.bias"] is None
    assert all(e is None or e < 1e-6 for e in errors.values()), errors
    assert errors["blocks.0.a.weight"] is not None and errors["blocks.0.b.weight"] is not None


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block(6, 10)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.block(self.block(x)))


def state_dict_clip_and_twice(rank, ws, tmp):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    net = _Twice()
    ref = reference_copy(net)
    mesh = make_mesh("zero3", ws)
    mfsdp.fully_shard(net.block, mesh)
    mfsdp.fully_shard(net, mesh)
    x = torch.randn(4, 6)
    net(x.chunk(ws)[rank]).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    out = {"names": [n for n, _ in net.named_parameters()] == [n for n, _ in ref.named_parameters()]}
    out["grad_err"] = max(float((p.grad.full_tensor() - q.grad).abs().max())
                          for p, q in zip(net.parameters(), ref.parameters()))
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    out["norm"] = (float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm), float(ref_norm))
    full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    out["full_sd_err"] = max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items())
    # DCP round trip into a fresh sharded model.
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": net.state_dict()}, checkpoint_id=tmp)
    torch.manual_seed(1)
    other = _Twice()
    mfsdp.fully_shard(other.block, mesh)
    mfsdp.fully_shard(other, mesh)
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=tmp)
    other.load_state_dict(state["model"])
    out["dcp_err"] = max(float((a.full_tensor() - b.full_tensor()).abs().max())
                         for a, b in zip(other.parameters(), net.parameters()))
    out["dcp_forward_err"] = float((other(x) - net(x)).abs().max())
    p = next(net.parameters())
    out["redistribute"] = float((p.redistribute(placements=[torch.distributed.tensor.Replicate()]).to_local()
                                 - p.full_tensor()).abs().max())
    net.zero_grad(set_to_none=False)
    out["zeroed"] = all(float(p.grad.full_tensor().abs().max()) == 0 for p in net.parameters())
    return out


def test_state_dict_clip_and_module_called_twice(world):
    tmp = tempfile.mkdtemp(prefix="mfsdp_dcp_")
    out = world(2).run(state_dict_clip_and_twice, tmp=tmp)[0]
    assert out["names"]
    assert out["grad_err"] < 1e-6
    assert abs(out["norm"][0] - out["norm"][1]) <= 1e-6 * out["norm"][1]
    assert out["full_sd_err"] == 0.0
    assert out["dcp_err"] == 0.0 and out["dcp_forward_err"] == 0.0
    assert out["redistribute"] == 0.0 and out["zeroed"]


def bf16_resting_memory(rank, ws):
    """bf16 compute, fp32 masters: at rest only the fp32 shard (no bf16 copy), and gradients
    dropped by zero_grad() free their memory before the next forward."""
    torch.manual_seed(0)
    net = Net(vocab=64, dim=32, hidden=64).to(torch.bfloat16)
    total = sum(p.numel() for p in net.parameters())
    shard_net(net, make_mesh("zero3", ws), make_placements("zero3"))
    groups = [g for m in net.modules() if isinstance(m, mfsdp.FsdpModule) for g in m.parameter_groups]

    def resting_bytes():
        size = 0
        for g in groups:
            for buf in {id(b): b for b in (g.main, g.model, g.unsharded, g.reducer.main_grad) if b is not None}.values():
                size += buf.tensor.untyped_storage().size()
        return size

    at_rest = resting_bytes()
    optim = mfsdp.fully_shard_optimizer(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    x, y = global_batch(0, 4, 5, 64)
    loss_fn(net(x), y).backward()
    with_grads = resting_bytes()
    optim.step()
    optim.zero_grad(set_to_none=True)
    # The step gathered the next forward's first two modules early (prefetch_across_step), nothing else.
    early = [m for m in net.modules() if isinstance(m, mfsdp.FsdpModule)
             for g in m.parameter_groups if g.unsharded.is_allocated and g.unsharded is not g.main]
    assert early == [net, net.blocks[0]], early
    held = sum(g.unsharded.tensor.untyped_storage().size() for m in early for g in m.parameter_groups)
    after_zero_grad = resting_bytes() - held  # gradients freed by the bound optimizer's zero_grad
    loss_fn(net(x), y).backward()
    net.zero_grad(set_to_none=True)  # a plain zero_grad: freed by the next root forward
    with torch.no_grad():
        net(x)
    assert resting_bytes() == after_zero_grad
    return total, at_rest, with_grads, after_zero_grad


def test_bf16_resting_memory(world):
    total, at_rest, with_grads, after_zero_grad = world(2).run(bf16_resting_memory)[0]
    shard_fp32 = 4 * total / 2
    padding = 4 * 4 * 64 * 4  # a row per parameter, generously
    assert at_rest <= shard_fp32 + padding, (at_rest, shard_fp32)
    assert with_grads >= at_rest + 2 * total / 2  # bf16 gradient shards appeared (counts live apart, in fp32)
    assert after_zero_grad == at_rest, (after_zero_grad, at_rest)


def meta_init(rank, ws, kind):
    """Build on the meta device, shard (each rank allocates only its shards), load full weights
    with torch's state-dict helper, then train in parity with the reference."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    torch.manual_seed(0)
    ref = Net()
    with torch.device("meta"):
        net = Net()
    shard_net(net, make_mesh(kind, ws), make_placements(kind))
    assert all(not p.is_meta for p in net.parameters())
    set_model_state_dict(net, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    optim = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        step_both(net, ref, optim, ref_optim, step, 4, rank, ws)
    return max(float((p.full_tensor() - q).abs().max()) for p, q in zip(net.parameters(), ref.parameters()))


@pytest.mark.parametrize("kind", ["zero3", "zero2"])
def test_meta_device_init(world, kind):
    assert world(2).run(meta_init, kind=kind)[0] < 1e-6


def units_and_roots(rank, ws):
    from mfsdp.runtime.module import fsdp_modules, fsdp_roots

    net = Net()
    mesh = make_mesh("zero3", ws)
    for block in net.blocks:
        mfsdp.fully_shard(block, mesh)
    before = [n for n, _ in fsdp_modules(net)], [r is b for r, b in zip(fsdp_roots(net), net.blocks)]
    mfsdp.fully_shard(net, mesh)
    net(torch.zeros(2, 3, dtype=torch.long))  # builds the context: the root rule then reads it
    return before, [n for n, _ in fsdp_modules(net)], [r is net for r in fsdp_roots(net)]


def test_one_walk_lists_the_units_and_one_rule_finds_the_roots(world):
    before, after, roots = world(2).run(units_and_roots)[0]
    assert before == (["blocks.0", "blocks.1", "blocks.2"], [True, True, True])
    assert after == ["", "blocks.0", "blocks.1", "blocks.2"] and roots == [True]

"""FP8 training (torchao float8 linears) under mfsdp, with FP8 all-gather (``mfsdp.float8``).

torchao 0.17 trains float8 on CPU under torch 2.13 (``torch._scaled_mm`` has CPU kernels for
e4m3/e5m2, tensorwise and rowwise scales), so parity runs here on gloo; the GPU cases rerun it on
NCCL. The reference is torchao's own unsharded float8 model fed the full batch as one slice per rank
(same dynamic activation scales as each rank), gradients averaged, same optimizer; torchao's FSDP2
tests compare the same way with the default ``assertEqual`` tolerance, used here.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

import mfsdp  # noqa: E402
import mfsdp.float8 as mf8  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated  # noqa: E402

DIM, HIDDEN, VOCAB, BLOCKS = 32, 64, 48, 3
E4M3 = torch.float8_e4m3fn


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = Mlp()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    """Embedding and head stay high precision; the blocks' MLPs become float8 linears."""

    def __init__(self, n_blocks: int = BLOCKS) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_net(recipe: str = "tensorwise", dtype=torch.float32, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net().to(dtype)
    convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda mod, fqn: ".mlp." in fqn)
    return net


def shard(net: Net, ws: int, fp8_gather: bool, policy=None, device="cpu", comm=None) -> Net:
    """The recipe of ``mfsdp.float8``: each MLP (float8 weights only) is a unit of its own."""
    from torch.distributed.device_mesh import init_device_mesh

    if fp8_gather:
        mf8.enable_fp8_all_gather(net)
    mesh = init_device_mesh(device, (ws,), mesh_dim_names=("dp",))
    placements = mfsdp.Placements.zero3("dp")
    for block in net.blocks:
        mfsdp.fully_shard(block.mlp, mesh, placements, mixed_precision_policy=policy, communication_policy=comm)
        mfsdp.fully_shard(block, mesh, placements, mixed_precision_policy=policy, communication_policy=comm)
    return mfsdp.fully_shard(net, mesh, placements, mixed_precision_policy=policy, communication_policy=comm)


def batch(step: int, n: int = 8, seq: int = 4, device="cpu"):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (n, seq + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def full_params(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
            for n, p in model.named_parameters()}


def codecs(net) -> list:
    return [g.codec for m in net.modules() if isinstance(m, mfsdp.FsdpModule) for g in m.parameter_groups
            if g.codec is not None]


# ------------------------------------------------------------------------------------ parity
def train_parity(rank, ws, recipe="tensorwise", fp8_gather=True, precompute=False, steps=4, device="cpu",
                 double_buffer=False, delay=False):
    from test_core_parity import _injected_delays

    with _injected_delays(delay):  # GPU: stalls every collective's stream, so a missing wait shows
        return _train_parity(rank, ws, recipe, fp8_gather, precompute, steps, device, double_buffer)


def _train_parity(rank, ws, recipe, fp8_gather, precompute, steps, device, double_buffer):
    net = make_net(recipe).to(device)
    ref = copy.deepcopy(net)
    shard(net, ws, fp8_gather, device=device,
          comm=mfsdp.CommunicationPolicy(double_buffer=True) if double_buffer else None)
    optim = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    losses, reductions = [], []
    for step in range(steps):
        x, y = batch(step, device=device)
        ref_loss = 0.0
        for sx, sy in zip(x.chunk(ws), y.chunk(ws)):  # the full batch, one rank's slice at a time
            loss = loss_fn(ref(sx), sy)
            loss.backward()
            ref_loss += loss.item() / ws
        for p in ref.parameters():
            p.grad.div_(ws)
        ref_optim.step()
        ref_optim.zero_grad()
        before = sum(c.amax_reductions for c in codecs(net))
        loss = loss_fn(net(x.chunk(ws)[rank]), y.chunk(ws)[rank])
        loss.backward()
        reductions.append(sum(c.amax_reductions for c in codecs(net)) - before)
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        if precompute:
            mf8.precompute_fp8_scales(net)
        mean = torch.tensor([loss.item()], device=device)
        torch.distributed.all_reduce(mean)
        losses.append((mean.item() / ws, ref_loss))
    got, want = full_params(net), full_params(ref)
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float32)[:, 0],
                               torch.tensor(losses, dtype=torch.float32)[:, 1])
    slotted = [g._slot is not None for b in net.blocks for g in b.mlp.parameter_groups]
    assert all(slotted) == double_buffer, slotted
    return reductions, len(codecs(net))


@pytest.mark.parametrize("recipe,fp8_gather,precompute,double_buffer", [
    ("tensorwise", True, False, False), ("tensorwise", True, True, False), ("tensorwise", True, False, True),
    ("tensorwise", False, False, False), ("rowwise", False, False, False)])
def test_parity_world2(world, recipe, fp8_gather, precompute, double_buffer):
    """Double buffering gathers the three MLPs into two persistent FP8 slots (the codec re-points
    its weights there)."""
    reductions, n_codecs = world(2).run(train_parity, recipe=recipe, fp8_gather=fp8_gather,
                                        precompute=precompute, double_buffer=double_buffer)[0]
    assert n_codecs == (BLOCKS if fp8_gather else 0)
    if fp8_gather:
        # forward and backward gather every MLP: an amax all-reduce each, unless precomputed
        assert reductions == ([2 * BLOCKS] + [0] * 3 if precompute else [2 * BLOCKS] * 4), reductions


# ---------------------------------------------------------------------- bytes on the wire
def gathered_bytes(rank, ws, fp8_gather):
    """(dtype, bytes per rank) of each all-gather of the first block's MLP, in a bf16 model."""
    from mfsdp.runtime import collectives

    net = make_net("tensorwise", dtype=torch.bfloat16)
    shard(net, ws, fp8_gather)
    mlp_group = net.blocks[0].mlp.parameter_groups[0]
    seen, original = [], collectives.all_gather

    def recording(outputs, inputs, group, *args, **kwargs):
        if outputs[0].data_ptr() == mlp_group.unsharded.tensor.data_ptr():
            sent = sum(t.numel() * t.element_size() for t in outputs) // ws  # each rank's share
            seen.append((str(outputs[0].dtype), sent, len(outputs)))
        return original(outputs, inputs, group, *args, **kwargs)

    collectives.all_gather = recording
    try:
        x, y = batch(0)
        loss_fn(net(x.chunk(ws)[rank]), y.chunk(ws)[rank]).backward()
    finally:
        collectives.all_gather = original
    return seen


def test_fp8_gather_moves_half_the_bf16_bytes(world):
    fp8 = world(2).run(gathered_bytes, fp8_gather=True)[0]
    bf16 = world(2).run(gathered_bytes, fp8_gather=False)[0]
    shard_numel = 2 * DIM * HIDDEN // 2
    assert fp8 == [("torch.float8_e4m3fn", shard_numel, 2)] * 2, fp8  # forward and backward, one launch each
    assert bf16 == [("torch.bfloat16", 2 * shard_numel, 2)] * 2, bf16


# --------------------------------------------------------------------- scales across shards
def scale_on_one_shard(rank, ws, main_offset):
    """w1's amax lives in the last rank's rows only (fp32 main weights of a bf16 model, nudged off
    the bf16 grid so the amax must be rounded first): every rank gathers torchao's cast of the
    whole bf16 weight, scale included, and computes torchao's output bit for bit."""
    net = make_net("tensorwise", dtype=torch.bfloat16)
    with torch.no_grad():
        net.blocks[0].mlp.w1.weight[HIDDEN - 1, 3] = 40.0  # row 63: the last rank's shard
    ref = copy.deepcopy(net)
    shard(net, ws, fp8_gather=True, policy=mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32))
    w1 = net.blocks[0].mlp.w1
    with torch.no_grad():
        local = w1.weight.to_local()
        if rank == ws - 1:
            local[-1, 3] += main_offset  # the main weight: between bf16 neighbours of 40
    full_main = w1.weight.full_tensor().detach()
    with torch.no_grad():
        ref.blocks[0].mlp.w1.weight.copy_(full_main.to(torch.bfloat16))
    seen = {}
    w1.register_forward_pre_hook(lambda m, a: seen.update(data=m.weight._data.clone(), scale=m.weight._scale.clone()))
    x, _ = batch(0)
    out, ref_out = net(x), ref(x)  # the same tokens on every rank
    weight = full_main.to(torch.bfloat16)
    scale = amax_to_scale(weight.abs().max(), E4M3)
    assert torch.equal(seen["scale"], scale), (seen["scale"], scale)
    assert torch.equal(seen["data"].view(torch.uint8), to_fp8_saturated(weight.float() * scale, E4M3).view(torch.uint8))
    assert torch.equal(out, ref_out), (out - ref_out).abs().max()
    return float(scale)


def test_scale_from_amax_on_one_shard(world):
    scales = world(2).run(scale_on_one_shard, main_offset=0.1)
    assert scales[0] == scales[1] == pytest.approx(448.0 / 40.0, rel=1e-2)


# ---------------------------------------------------------------------------- bad inputs
def error_of(fn) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bad_inputs(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))

    def mixed():  # the block's norm shares the float8 weights' group
        net = make_net()
        mf8.enable_fp8_all_gather(net)
        mfsdp.fully_shard(net.blocks[0], mesh)

    def replicated():
        net = make_net()
        mf8.enable_fp8_all_gather(net)
        mfsdp.fully_shard(net.blocks[0].mlp, mesh, mfsdp.Placements.zero2("dp"))

    return {"mixed": error_of(mixed), "replicated": error_of(replicated),
            "rowwise": error_of(lambda: mf8.enable_fp8_all_gather(make_net("rowwise"))),
            "no_float8": error_of(lambda: mf8.enable_fp8_all_gather(nn.Linear(16, 16)))}


def test_bad_inputs(world):
    out = world(2).run(bad_inputs)[0]
    assert out["mixed"].startswith("ValueError") and "mixes parameters gathered through ['_Float8WeightSpec']" \
        in out["mixed"] and "(32,)" in out["mixed"], out["mixed"]
    assert out["replicated"].startswith("NotImplementedError") and "replicated" in out["replicated"], out
    assert out["rowwise"].startswith("ValueError") and "tensorwise" in out["rowwise"], out
    assert out["no_float8"].startswith("ValueError") and "convert_to_float8_training" in out["no_float8"], out


def test_torchao_missing_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8.float8_linear", None)
    with pytest.raises(ImportError, match="pip install torchao==0.17.0"):
        mf8.enable_fp8_all_gather(nn.Linear(16, 16))


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precompute,double_buffer,delay", [(False, False, False), (True, False, True),
                                                          (False, True, True)])
def test_cuda_parity(cuda_world, precompute, double_buffer, delay):
    cuda_world.run(train_parity, precompute=precompute, double_buffer=double_buffer, delay=delay, device="cuda")

"""FP8 training (torchao float8 linears) under mfsdp, with FP8 all-gather (``mfsdp.transforms.float8_linear``).

torchao 0.17 trains float8 on CPU under torch 2.13 (``torch._scaled_mm`` has CPU kernels for
e4m3/e5m2, tensorwise and rowwise scales), so parity runs here on gloo; the GPU cases rerun it on
NCCL. The reference is torchao's own unsharded float8 model fed the full batch as one slice per rank
(same dynamic activation scales as each rank), gradients averaged, same optimizer; torchao's FSDP2
tests compare the same way with the default ``assertEqual`` tolerance, used here.

Two shardings: a block as one unit (its float8 weights and its norm in one group, one gather per
block, the recipe), and the MLP as a unit of its own inside the block (groups of float8 weights
only); a llama block (``mfsdp.models``) through ``parallelize`` with a ``Float8Transform`` as ``mfsdp train`` does.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

import mfsdp  # noqa: E402
import mfsdp.transforms.float8_linear as mf8  # noqa: E402
from test_train_e2e import corpus  # noqa: E402,F401  (the token file fixture of the train tests)
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


def shard(net: Net, ws: int, fp8_gather: bool, policy=None, device="cpu", comm=None, mlp_units=False,
          kind="zero3") -> Net:
    """The recipe of ``mfsdp.transforms.float8_linear``: each block one unit (float8 weights and the norm in one group);
    with ``mlp_units`` each MLP (float8 weights only) is a unit of its own inside its block. ``kind``:
    zero3 over all ranks, or hsdp / hfsdp over a (2, ws / 2) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if fp8_gather:
        mf8.enable_fp8_all_gather(net)
    if kind == "zero3":
        mesh = init_device_mesh(device, (ws,), mesh_dim_names=("dp",))
        placements = mfsdp.Placements.zero3("dp")
    else:
        mesh = init_device_mesh(device, (2, ws // 2), mesh_dim_names=("replicate", "shard"))
        placements = getattr(mfsdp.Placements, kind)("replicate", "shard")
    for block in net.blocks:
        if mlp_units:
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


LLAMA = dict(dim=DIM, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=HIDDEN, vocab_size=VOCAB, max_seq_len=16)


def make_llama(dtype=torch.float32):
    """A small ``mfsdp.models`` Llama and torchao's float8 conversion of a copy of it (every linear
    but the head, as ``mfsdp.transforms.float8_linear.float8_filter`` picks)."""
    from mfsdp.models.llama import Llama, LlamaConfig

    net = Llama(LlamaConfig(**LLAMA), dtype=dtype)
    net.init_weights(seed=0)
    ref = copy.deepcopy(net)
    convert_to_float8_training(ref, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=lambda mod, fqn: fqn != "output")
    return net, ref


def parallelize_llama(net, ws, float8="tensorwise", policy=None, comm=None):
    """``mfsdp.models.parallelize`` with ``float8`` ("none" or a recipe, as ``Float8Transform``): one unit per
    block, as ``mfsdp train`` cuts it."""
    from mfsdp.transforms.float8 import Float8Transform
    from mfsdp.mesh import build_mesh
    from mfsdp.models.parallelize import ParallelizeConfig, parallelize

    transforms = () if float8 == "none" else (Float8Transform(float8),)
    parallelize(net, build_mesh("cpu", ws), ParallelizeConfig(transforms=transforms, mixed_precision=policy))
    return net


# ------------------------------------------------------------------------------------ parity
def train_parity(rank, ws, recipe="tensorwise", fp8_gather=True, precompute=False, steps=4, device="cpu",
                 double_buffer=False, delay=False, mlp_units=False, kind="zero3"):
    from test_core_parity import _injected_delays

    with _injected_delays(delay):  # GPU: stalls every collective's stream, so a missing wait shows
        return _train_parity(rank, ws, recipe, fp8_gather, precompute, steps, device, double_buffer, mlp_units,
                             kind)


def _train_parity(rank, ws, recipe, fp8_gather, precompute, steps, device, double_buffer, mlp_units=False,
                  kind="zero3"):
    net = make_net(recipe).to(device)
    ref = copy.deepcopy(net)
    shard(net, ws, fp8_gather, device=device, mlp_units=mlp_units, kind=kind,
          comm=mfsdp.CommunicationPolicy(double_buffer=True) if double_buffer else None)
    reductions = train_and_compare(rank, ws, net, ref, precompute, steps, device)
    units = [b.mlp if mlp_units else b for b in net.blocks]
    slotted = [g._slot is not None for u in units for g in u.parameter_groups]
    assert all(slotted) == double_buffer, slotted
    return reductions, len(codecs(net))


def train_and_compare(rank, ws, net, ref, precompute, steps, device="cpu"):
    """Train the sharded ``net`` and torchao's unsharded ``ref`` alike (``ref`` on the full batch,
    slice by slice); compare losses and final weights. Returns the gather-time amax all-reduces
    of each step."""
    optim = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    if precompute == "bound":  # mfsdp's binding: the first block is gathered inside the step, then
        optim = mfsdp.fully_shard_optimizer(net, optim)  # the hook precomputes the others' scales
        mf8.precompute_fp8_scales_after(optim, net)
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
        if precompute is True or (precompute == "once" and step == 0):
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
    return reductions


@pytest.mark.parametrize("recipe,fp8_gather,precompute,double_buffer,mlp_units", [
    ("tensorwise", True, False, False, False), ("tensorwise", True, True, False, False),
    ("tensorwise", True, False, True, False), ("tensorwise", True, False, True, True),
    ("tensorwise", False, False, False, False), ("rowwise", False, False, False, False)])
def test_parity_world2(world, recipe, fp8_gather, precompute, double_buffer, mlp_units):
    """Each block one group (float8 weights and the norm's weight and bias), or its MLP a group of
    float8 weights only; double buffering gathers the three units into two persistent slots (the
    codec re-points its weights there, the norm's parameters are re-pointed as usual)."""
    reductions, n_codecs = world(2).run(train_parity, recipe=recipe, fp8_gather=fp8_gather, precompute=precompute,
                                        double_buffer=double_buffer, mlp_units=mlp_units)[0]
    assert n_codecs == (BLOCKS if fp8_gather else 0)
    if fp8_gather:
        # forward and backward gather every block: an amax all-reduce each, unless precomputed
        assert reductions == ([2 * BLOCKS] + [0] * 3 if precompute else [2 * BLOCKS] * 4), reductions


@pytest.mark.parametrize("precompute", ["once", "bound"])
def test_precomputed_scales_are_never_stale(world, precompute):
    """Scales precomputed once and then not again: every later step's weights are new, so the gathers
    compute their scales afresh (a step bumps the groups' weights epoch; tensor versions could not
    tell: a fused step bumps none, nor do DTensor's in-place ops on the local shards). With the
    bound optimizer, the block gathered during the step (``prefetch_across_step``) computes its
    scale from its updated weights, and the hook precomputes the others'. Parity with torchao."""
    reductions, _ = world(2).run(train_parity, precompute=precompute)[0]
    assert reductions == ([2 * BLOCKS, 0] + [2 * BLOCKS] * 2 if precompute == "once" else [2 * BLOCKS] + [0] * 3), \
        reductions


@pytest.mark.parametrize("kind", ["hsdp", "hfsdp"])
@pytest.mark.parametrize("precompute", [False, True])
def test_parity_two_axis_placements(world, kind, precompute):
    """HSDP and HFSDP on a (2, 2) mesh: the scales' amax is reduced over the axes the gathered
    shard is split over (HFSDP gathers its compute weights from a level the replicate axis
    already covers), and precomputed scales over every axis of the main shard."""
    reductions, n_codecs = world(4).run(train_parity, precompute=precompute, kind=kind)[0]
    assert n_codecs == BLOCKS
    assert reductions == ([2 * BLOCKS] + [0] * 3 if precompute else [2 * BLOCKS] * 4), reductions


def llama_parity(rank, ws, precompute):
    """A llama block as ONE group: seven float8 weights (gathered as float8) and two RMSNorm scales
    (gathered in the compute dtype) in one coalesced gather, against torchao's unsharded model."""
    net, ref = make_llama()
    parallelize_llama(net, ws)
    shapes = []
    for block in net.layers:
        (group,) = block.parameter_groups  # one group per block: one gather per transition
        assert len(group.encoded.tagged) == 7 and len(group.encoded.plain) == 2, group.encoded.plain
        shapes.append([str(r.dtype) for r in group._unsharded_regions])
    reductions = train_and_compare(rank, ws, net, ref, precompute, steps=3)
    return reductions, shapes[0]


@pytest.mark.parametrize("precompute", [False, True])
def test_llama_block_one_group_parity(world, precompute):
    reductions, dtypes = world(2).run(llama_parity, precompute=precompute)[0]
    f8, f32 = "torch.float8_e4m3fn", "torch.float32"
    assert dtypes == [f32] + [f8] * 4 + [f32] + [f8] * 3, dtypes  # block order: norm, attention, norm, FFN
    assert reductions == ([4] + [0] * 2 if precompute else [4] * 3), reductions


# ---------------------------------------------------------------------- bytes on the wire
FP32_MAIN = dict(main_params_dtype=torch.float32)


def gathered_bytes(rank, ws, float8):
    """(dtype, bytes per rank, tensors) of each all-gather of the first llama block, in a bf16 model
    with fp32 main weights."""
    from mfsdp.runtime import collectives

    net, _ = make_llama(torch.bfloat16)
    parallelize_llama(net, ws, float8, policy=mfsdp.MixedPrecisionPolicy(**FP32_MAIN))
    (group,) = net.layers[0].parameter_groups
    seen, original = [], collectives.all_gather

    def recording(outputs, inputs, group_, *args, **kwargs):
        if outputs[0].data_ptr() == group.unsharded.tensor.data_ptr():
            sent = sum(t.numel() * t.element_size() for t in outputs) // ws  # each rank's share
            seen.append((str(outputs[0].dtype), sent, len(outputs)))
        return original(outputs, inputs, group_, *args, **kwargs)

    collectives.all_gather = recording
    try:
        x, y = batch(0)
        loss_fn(net(x.chunk(ws)[rank]), y.chunk(ws)[rank]).backward()
    finally:
        collectives.all_gather = original
    return seen


def test_one_gather_per_block_with_float8_bytes(world):
    """A llama block's nine parameters travel in one launch per transition (forward, backward): the
    seven linear weights as float8, the two norm scales as bf16, all as bytes."""
    fp8 = world(2).run(gathered_bytes, float8="tensorwise")[0]
    bf16 = world(2).run(gathered_bytes, float8="none")[0]
    d, h = DIM, HIDDEN
    linears = 2 * d * d + 2 * (d // 2) * d + 3 * d * h  # wq, wo; wk, wv (one kv head of 16); w1, w3, w2
    norms = 2 * d
    assert fp8 == [("torch.uint8", (linears + 2 * norms) // 2, 9)] * 2, fp8
    assert bf16 == [("torch.bfloat16", 2 * (linears + norms) // 2, 9)] * 2, bf16


# ------------------------------------------------------------------ kernels on the gather path
# What one unshard of a bf16 llama block (fp32 main weights, ZeRO-3) dispatched at commit 1eafb34,
# before groups could mix encodings: views of this rank's blocks, one fused cast, one coalesced
# gather. A group without tagged parameters must still do exactly this.
BF16_BLOCK_UNSHARD = ["aten.slice.Tensor"] * 9 + ["aten._foreach_copy_.default",
                                                  "c10d.allgather_into_tensor_coalesced_.default"]
VIEWS = ("slice", "view", "detach", "split", "unbind", "lift_fresh", "alias")


def unshard_ops(rank, ws, model, float8):
    """The ops one unshard + reshard of each group dispatches (twice: the first gather of a tagged
    group also makes its views), by unit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    if model == "llama":
        net, _ = make_llama(torch.bfloat16)
        parallelize_llama(net, ws, float8, policy=mfsdp.MixedPrecisionPolicy(**FP32_MAIN))
        units = {"block": net.layers[0], "head": net.output, "root": net}
    else:
        net = make_net(dtype=torch.bfloat16)
        shard(net, ws, fp8_gather=float8 != "none", policy=mfsdp.MixedPrecisionPolicy(**FP32_MAIN))
        units = {"block": net.blocks[0]}
    out = {}
    for name, unit in units.items():
        (group,) = unit.parameter_groups
        out[name] = []
        for _ in range(2):
            ops = []
            with Log():
                group.unshard(None)
                group.reshard(None)
            out[name].append(ops)
    return out


def kernels(ops: list) -> list:
    return sorted(op for op in ops if not any(v in op for v in VIEWS))


def test_untagged_gather_path_unchanged_and_encode_is_fused(world):
    plain = world(2).run(unshard_ops, model="llama", float8="none")[0]
    fp8 = world(2).run(unshard_ops, model="llama", float8="tensorwise")[0]
    mlp_fp8 = world(2).run(unshard_ops, model="net", float8="tensorwise")[0]
    # No tag: exactly the ops of before, every time; an untagged group beside float8 ones likewise.
    assert plain["block"] == [BF16_BLOCK_UNSHARD] * 2, plain["block"]
    assert fp8["head"] == plain["head"] and fp8["root"] == plain["root"], (fp8["head"], plain["head"])
    # Tagged: one coalesced gather; the encode's kernels do not grow with the weights (seven in a
    # llama block, two in the small MLP block); the second gather reuses the first one's views.
    first, second = fp8["block"]
    assert first.count("c10d.allgather_into_tensor_coalesced_.default") == 1, first
    assert kernels(first) == kernels(mlp_fp8["block"][0]), (kernels(first), kernels(mlp_fp8["block"][0]))
    assert kernels(second) == kernels(mlp_fp8["block"][1])
    assert len(kernels(second)) <= 24, kernels(second)
    assert second.count("aten.slice.Tensor") == first.count("aten.slice.Tensor") - 9, second  # no own_blocks


# ------------------------------------------------------------------- the encode, member by member
def encode_against_torchao(device: str, source_dtype: torch.dtype, compute_dtype: torch.dtype, wire_dtype,
                           staging_numel: int) -> None:
    """``Float8GatherCodec.encode`` of members whose sizes are no multiple of the staging row (one of a
    single element, one spanning several rows), each holding its own amax at the edge of its row,
    writes torchao's ``to_fp8_saturated(w.to(compute).float() * scale)`` bytes into every block, with
    torchao's scale of each member, in one pass and in several."""
    gen = torch.Generator().manual_seed(0)
    sizes = [1, 7, mf8.ENCODE_ROW - 1, mf8.ENCODE_ROW + 3, 3 * mf8.ENCODE_ROW + 17]
    # As the runtime passes them: the sources are views of one main buffer and the blocks views of one
    # gather buffer, each at its own offset with a gap before it (padding, another rank's block).
    gap = 5
    main = torch.zeros(sum(sizes) + gap * len(sizes), dtype=source_dtype, device=device)
    gathered = torch.full((sum(sizes) + 3 * gap * len(sizes),), 0x55, dtype=torch.uint8, device=device)
    sources, blocks, at, out_at = [], [], 0, 0
    for k, n in enumerate(sizes):
        w = torch.randn(n, generator=gen) * 10 ** (k - 2)  # scales from 1e-2 to 1e2
        w[-1] = -1.37 * w.abs().max()  # the amax, negative, in the last element of the member
        at, out_at = at + gap, out_at + 3 * gap
        sources.append(main[at:at + n])
        sources[-1].copy_(w)
        blocks.append(gathered[out_at:out_at + n].view(wire_dtype))
        at, out_at = at + n, out_at + n
    outside = torch.ones_like(gathered, dtype=torch.bool)
    for block in blocks:
        outside[block.storage_offset():block.storage_offset() + block.numel()] = False
    spec = mf8._Float8WeightSpec(None, wire_dtype, False)
    codec = mf8.Float8GatherCodec([spec] * len(sizes), compute_dtype)
    default, mf8.ENCODE_STAGING_NUMEL = mf8.ENCODE_STAGING_NUMEL, staging_numel
    try:
        codec.encode(sources, blocks, [], weights_epoch=0)
    finally:
        mf8.ENCODE_STAGING_NUMEL = default
    for k, (w, block) in enumerate(zip(sources, blocks)):
        seen = w.to(compute_dtype).float()
        scale = amax_to_scale(seen.abs().max(), wire_dtype, False)
        assert torch.equal(codec._scales[k], scale), (k, codec._scales[k], scale)
        expected = to_fp8_saturated(seen * scale, wire_dtype)
        assert torch.equal(block.view(torch.uint8), expected.view(torch.uint8)), (k, sizes[k])
    assert bool((gathered[outside] == 0x55).all()), "the encode wrote outside its blocks"


ENCODE_CASES = [(torch.float32, torch.bfloat16, E4M3, 1 << 26), (torch.bfloat16, torch.bfloat16, E4M3, 1 << 26),
                (torch.float32, torch.float32, E4M3, 1 << 26), (torch.float32, torch.bfloat16, torch.float8_e5m2, 1 << 26),
                (torch.float32, torch.bfloat16, E4M3, 2 * mf8.ENCODE_ROW)]


@pytest.mark.parametrize("source,compute,wire,staging", ENCODE_CASES)
def test_encode_bytes_equal_torchaos_cast(source, compute, wire, staging):
    encode_against_torchao("cpu", source, compute, wire, staging)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("source,compute,wire,staging", ENCODE_CASES)
def test_cuda_encode_bytes_equal_torchaos_cast(source, compute, wire, staging, monkeypatch):
    """On CUDA the fused kernel (``mfsdp.kernels``) writes those bytes, not the staged path."""
    from mfsdp import kernels

    if kernels.available("cuda"):
        def refuse(*args):
            raise AssertionError("the staged encode ran on CUDA where the fused kernel should")
        monkeypatch.setattr(mf8.Float8GatherCodec, "_cast_staged", refuse)
    encode_against_torchao("cuda", source, compute, wire, staging)


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
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
    tensorwise = Float8LinearConfig.from_recipe_name("tensorwise")

    def two_scalings():  # w1 and w2 of one block scaled differently: one group, two float8 settings
        net = Net()
        convert_to_float8_training(net, config=tensorwise, module_filter_fn=lambda m, fqn: fqn.endswith("mlp.w1"))
        convert_to_float8_training(net, config=dataclasses.replace(tensorwise, round_scales_to_power_of_2=True),
                                   module_filter_fn=lambda m, fqn: fqn.endswith("mlp.w2"))
        mf8.enable_fp8_all_gather(net)
        mfsdp.fully_shard(net.blocks[0], mesh)

    def replicated():
        net = make_net()
        mf8.enable_fp8_all_gather(net)
        mfsdp.fully_shard(net.blocks[0], mesh, mfsdp.Placements.zero2("dp"))

    return {"two_scalings": error_of(two_scalings), "replicated": error_of(replicated),
            "rowwise": error_of(lambda: mf8.enable_fp8_all_gather(make_net("rowwise"))),
            "rowwise_gather": error_of(lambda: mf8.convert_to_float8(Net(), "rowwise", fp8_all_gather=True)),
            "recipe": error_of(lambda: mf8.convert_to_float8(Net(), "blockwise")),
            "no_float8": error_of(lambda: mf8.enable_fp8_all_gather(nn.Linear(16, 16)))}


def test_bad_inputs(world):
    out = world(2).run(bad_inputs)[0]
    assert out["two_scalings"].startswith("ValueError") and "different (float8 dtype, power-of-2 scales)" \
        in out["two_scalings"], out["two_scalings"]
    assert out["replicated"].startswith("NotImplementedError") and "replicated" in out["replicated"], out
    assert out["rowwise"].startswith("ValueError") and "tensorwise" in out["rowwise"], out
    assert out["rowwise_gather"].startswith("ValueError") and "needs the tensorwise recipe" in out["rowwise_gather"]
    assert out["recipe"].startswith("ValueError") and "tensorwise, rowwise" in out["recipe"], out
    assert out["no_float8"].startswith("ValueError") and "convert_to_float8_training" in out["no_float8"], out


def test_torchao_missing_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8.float8_linear", None)
    with pytest.raises(ImportError, match="pip install torchao==0.17.0"):
        mf8.enable_fp8_all_gather(nn.Linear(16, 16))


# ------------------------------------------------------------------------------ mfsdp train
def test_train_float8_tensorwise(world, tmp_path, corpus):
    """``mfsdp train --model.float8 tensorwise`` on two CPU ranks (the trainer in this module's world;
    the launch itself is test_train_e2e.py's): every block one unit gathering float8 weights, scales
    precomputed after each step; the loss falls, close to the same run without float8 but not equal
    to it (the linears did run in float8). A resume from step 3 reproduces steps 4-6 bit for bit:
    scales precomputed from the weights before a checkpoint load (torch's optimizer-state init steps
    the optimizer) must not survive the load."""
    from test_eval_loss import run_trainer
    from test_train_e2e import SMALL, losses, stopped_copy

    def train(out, *extra):
        world(2).run(run_trainer, argv=[*SMALL, "--data.path", str(corpus), "--train.steps", "6",
                                        "--train.sample_tokens", "0", "--train.out_dir", str(out), *extra])
        return losses(out)

    fp8 = train(tmp_path / "tensorwise", "--model.float8", "tensorwise", "--train.checkpoint_every", "3")
    plain = train(tmp_path / "none", "--train.checkpoint_every", "0")
    assert sorted(fp8) == list(range(1, 7)) and fp8[6] < fp8[1] - 0.3, fp8
    assert fp8 != plain and abs(fp8[6] - plain[6]) < 0.01 * plain[6], (fp8, plain)
    resumed = train(stopped_copy(tmp_path / "tensorwise", 3, tmp_path / "resumed"), "--model.float8", "tensorwise",
                    "--resume")
    assert resumed == {step: loss for step, loss in fp8.items() if step > 3}, (resumed, fp8)


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precompute,double_buffer,delay", [(False, False, False), (True, False, True),
                                                          (False, True, True)])
def test_cuda_parity(cuda_world, precompute, double_buffer, delay):
    cuda_world.run(train_parity, precompute=precompute, double_buffer=double_buffer, delay=delay, device="cuda")

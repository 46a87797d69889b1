"""Initialization at any scale (issue 13): build on meta, shard, then materialise and initialise
only each rank's shards, with the weights of an unsharded init at every world size; the 70b
preset; and the FSDP2/torchtitan recipe (meta -> fully_shard -> to_empty -> init_weights).

CPU, gloo, worlds of 1, 2 and 4 ranks.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mfsdp
from mfsdp.models import flops
from mfsdp.models import llama as llama_module
from mfsdp.models.llama import PRESETS, Llama, get_config, normal_by_rows_
from mfsdp.models.moe import build_model
from _dist import World
from models import global_batch, loss_fn

pytestmark = pytest.mark.timeout(600)

SEED = 7
# Small, with row counts that do not divide by 2 or 4 (uneven shards) and a chunk of 200 elements,
# so that chunks straddle the shard boundaries (e.g. 4-row chunks of the 48-wide matrices).
SHAPE = ["--model.preset", "tiny", "--model.dim", "48", "--model.n_layers", "2", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--model.ffn_dim", "80", "--model.vocab_size", "101",
         "--data.seq_len", "16"]
MOE_SHAPE = ["--model.preset", "moe-tiny", "--model.dim", "32", "--model.n_layers", "2",
             "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_dim", "40",
             "--model.vocab_size", "61", "--data.seq_len", "16"]
CHUNK = 200


def _run_config(shape, placements, replicate, compute, extra=()):
    from mfsdp.train.run.resolve import load_config

    return load_config([*shape, "--train.device", "cpu", "--train.seed", str(SEED),
                        "--parallel.placements", placements, "--parallel.replicate", str(replicate),
                        "--parallel.compute_dtype", compute, "--train.progress", "false", *extra])


def _tokens(vocab):
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))


def trainer_build(rank, ws, shape, placements, replicate, compute, extra=()):
    """``mfsdp.train.build.model.build`` (meta -> parallelize -> to_empty -> init_weights) on every rank; rank 0
    returns the gathered main weights, the logits of a first forward and the rank's shard sizes."""
    from mfsdp.train.build.model import build

    llama_module.INIT_CHUNK_NUMEL = CHUNK
    try:
        cfg = _run_config(shape, placements, replicate, compute, extra)
        model, _ = build(cfg, torch.device("cpu"), ws, print)
    finally:
        llama_module.INIT_CHUNK_NUMEL = 1 << 22
    assert all(isinstance(m, mfsdp.FsdpModule) for m in (model, model.layers[0]))
    assert all(not b.is_meta for b in model.buffers())
    full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    local = sum(p.to_local().numel() for p in model.parameters())
    with torch.no_grad():
        logits = model(_tokens(cfg.resolved.shape.vocab_size)).float()
    return (full, logits, local) if rank == 0 else local


def _reference(shape, extra=()):
    """The unsharded model, initialised with the same seed and chunk."""
    cfg = _run_config(shape, "zero3", 1, "fp32", extra).resolved.shape
    llama_module.INIT_CHUNK_NUMEL = CHUNK
    try:
        ref = build_model(cfg)
        ref.init_weights(seed=SEED)
    finally:
        llama_module.INIT_CHUNK_NUMEL = 1 << 22
    return ref


@pytest.mark.parametrize("ws, placements, replicate", [
    (1, "zero3", 1), (2, "zero3", 1), (4, "zero3", 1),
    (2, "zero2", 1), (2, "zero1", 1), (2, "ddp", 1), (4, "hsdp", 2), (4, "hfsdp", 2),
])
def test_sharded_init_is_bit_identical_to_the_unsharded_init(world, ws, placements, replicate):
    """Every world size and placement gives bit-identical full weights, equal to an unsharded
    ``init_weights`` with the same seed, and the first forward uses them (compute weights were
    refreshed after the in-place init)."""
    ref = _reference(SHAPE)
    results = world(ws).run(trainer_build, shape=SHAPE, placements=placements, replicate=replicate,
                            compute="fp32")
    full, logits, _ = results[0]
    want = dict(ref.named_parameters())
    assert full.keys() == want.keys()
    for name, value in full.items():
        assert torch.equal(value, want[name].detach()), name
    assert float(want["layers.0.attention.wq.weight"].detach().std()) == pytest.approx(0.02, rel=0.1)
    with torch.no_grad():
        torch.testing.assert_close(logits, ref(_tokens(101)), rtol=1e-5, atol=1e-6)
    if placements in ("zero3", "hfsdp") and ws > 1:  # each rank allocated only its part
        total = sum(v.numel() for v in full.values())
        assert max(r if isinstance(r, int) else r[2] for r in results) <= total // ws + 1000


def test_bf16_compute_keeps_fp32_draws_and_moe_experts_as_units(world):
    """bf16 compute with fp32 main weights: the main weights are the fp32 draws themselves (not a
    bf16 rounding), and a mixture of experts with each block's stacked experts a unit of their own
    draws the same too."""
    ref = _reference(SHAPE)
    full, logits, _ = world(2).run(trainer_build, shape=SHAPE, placements="zero3", replicate=1,
                                   compute="bf16")[0]
    for name, p in ref.named_parameters():
        assert full[name].dtype == torch.float32 and torch.equal(full[name], p.detach()), name
    bf16 = _reference(SHAPE).to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(logits, bf16(_tokens(101)).float(), rtol=0.02, atol=0.02)

    moe_ref = _reference(MOE_SHAPE)
    full, _, _ = world(2).run(trainer_build, shape=MOE_SHAPE, placements="zero3", replicate=1,
                              compute="fp32", extra=("--parallel.expert_units", "true"))[0]
    for name, p in moe_ref.named_parameters():
        assert torch.equal(full[name], p.detach()), name


def test_normal_by_rows_fills_any_local_block():
    """The helper on its own: a block of rows and columns of the whole tensor, read through its
    offset, holds exactly the whole tensor's values there; a Partial placement is refused."""
    whole = normal_by_rows_(torch.empty(37, 11), 0.5, seed=1, key="w", chunk_numel=40)
    again = normal_by_rows_(torch.empty(37, 11, dtype=torch.bfloat16), 0.5, seed=1, key="w", chunk_numel=40)
    assert torch.equal(again, whole.to(torch.bfloat16))
    assert not torch.equal(normal_by_rows_(torch.empty(37, 11), 0.5, seed=1, key="v", chunk_numel=40), whole)
    assert whole.std().item() == pytest.approx(0.5, rel=0.2)
    # Chunks are the unit of the stream: another chunk size is another (equally valid) init.
    assert not torch.equal(normal_by_rows_(torch.empty(37, 11), 0.5, seed=1, key="w", chunk_numel=80), whole)


def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (Linux >= 4.0)
        return True
    except OSError:
        return False


def peak_during_build(rank, ws, shape):
    """Peak RSS growth on each rank while ``build`` runs for ``shape`` (bf16 compute, fp32
    main weights, as on GPU); a tiny build first, so imports and process groups are warm."""
    import gc

    from mfsdp.train.build.model import build

    build(_run_config(SHAPE, "zero3", 1, "bf16"), torch.device("cpu"), ws, print)
    gc.collect()
    if not _reset_peak_rss():
        return None
    base = _vm_hwm_bytes()
    model, optimizer = build(_run_config(shape, "zero3", 1, "bf16"), torch.device("cpu"), ws, print)
    grown = _vm_hwm_bytes() - base
    local = sum(p.to_local().numel() for p in model.parameters())
    del model, optimizer
    gc.collect()
    return grown, local


def test_no_rank_holds_the_whole_model_while_building(world):
    """On 4 ranks, building a 200M-parameter model (800 MB in fp32, 400 MB in bf16) raises each
    rank's peak memory by about its fp32 shard (200 MB), plus transients of one unit's bf16 gather
    buffer (allocated and released at fully_shard) and one init chunk: less than the whole bf16
    model, which the old build (to_empty + init_weights, then parallelize) held on every rank on
    top of the shard."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    shape = ["--model.preset", "tiny", "--model.dim", "1024", "--model.n_layers", "16",
             "--model.n_heads", "8", "--model.n_kv_heads", "4", "--model.ffn_dim", "2816",
             "--model.vocab_size", "8192", "--data.seq_len", "64"]
    cfg = _run_config(shape, "zero3", 1, "bf16").resolved.shape
    total = flops.param_counts(cfg)["total"]
    # A world of its own whose glibc maps every allocation over 128 KiB separately and unmaps it
    # when freed (a fixed threshold turns off glibc's adaptive one), so the peak RSS follows the
    # live tensors instead of the heap's fragmentation. Spawned: glibc reads it at process start.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    try:
        own = World(4, spawn=True)
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    try:
        results = own.run(peak_during_build, shape=shape)
    finally:
        own.close()
    if any(r is None for r in results):
        pytest.skip("cannot reset the peak RSS here")
    largest_unit_bf16 = max(flops.param_counts(cfg)["per_block"], cfg.vocab_size * cfg.dim) * 2
    for grown, local in results:
        assert local <= total / 4 + 16 * 1024
        bound = local * 4 + largest_unit_bf16 + 2 * llama_module.INIT_CHUNK_NUMEL * 4 + 32 * 2**20
        assert grown < bound, (grown / 2**20, bound / 2**20)
        assert grown < total * 2, (grown / 2**20, total * 2 / 2**20)  # the whole model in bf16


# ------------------------------------------------------------------------------- 70b preset
def test_70b_preset_is_the_llama3_70b_shape_and_builds_on_meta_for_free():
    cfg = get_config("70b")
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size) == (
        8192, 80, 64, 8, 28672, 128256)
    assert cfg.rope_theta == 500000.0 and not cfg.tie_embeddings
    counts = flops.param_counts(cfg)
    assert 70.5e9 < counts["total"] < 70.6e9  # Llama-3-70B: 70.55B
    n = counts["non_embedding"]
    assert flops.flops_per_token(cfg, 8192) == 6.0 * n + 12.0 * 80 * 8192 * 8192
    assert 4.8e11 < flops.flops_per_token(cfg, 8192) < 4.82e11  # 417 GFLOP of weights + 64 of attention
    start = time.perf_counter()
    with torch.device("meta"):
        model = Llama(cfg, dtype=torch.bfloat16)
    assert time.perf_counter() - start < 30
    assert sum(p.numel() for p in model.parameters()) == counts["total"]
    assert all(p.is_meta for p in model.parameters())
    model.init_weights()  # on meta: draws nothing, allocates nothing
    assert all(p.is_meta for p in model.parameters())


def test_70b_preset_reaches_the_trainer_config():
    from mfsdp.train.run.resolve import load_config

    cfg = load_config(["--model.preset", "70b", "--data.seq_len", "8192"]).resolved.shape
    assert cfg == get_config("70b", max_seq_len=8192)
    assert "70b" in PRESETS


# -------------------------------------------------------------- FSDP2 / torchtitan recipe
class TitanBlock(nn.Module):
    """A torchtitan-style block: its own ``init_weights`` with trunc_normal_ and norm resets."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, freqs_cis):
        q = self.wq(self.attention_norm(x))
        rotated = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2)) * freqs_cis[: x.shape[1]]
        x = x + torch.view_as_real(rotated).flatten(-2).type_as(x)
        return x + self.w2(F.silu(self.w1(x)))

    def init_weights(self, init_std: float):
        for linear in (self.wq, self.w1):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=init_std)
        self.attention_norm.reset_parameters()


class TitanLike(nn.Module):
    """Like torchtitan's Llama 3: a complex ``freqs_cis`` buffer (non-persistent) that
    ``init_weights`` rebuilds on ``buffer_device``, nn.init on every weight, blocks in a
    ModuleDict."""

    def __init__(self, vocab=67, dim=16, n_layers=2, hidden=40, max_seq=32):
        super().__init__()
        self.dim, self.max_seq = dim, max_seq
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, hidden) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def _precompute_freqs_cis(self):
        freqs = 1.0 / (10000 ** (torch.arange(0, self.dim, 2).float() / self.dim))
        angles = torch.outer(torch.arange(self.max_seq).float(), freqs)
        return torch.polar(torch.ones_like(angles), angles)

    def init_weights(self, buffer_device=None):
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        nn.init.normal_(self.tok_embeddings.weight)
        for i, layer in enumerate(self.layers.values()):
            layer.init_weights(0.02 / (2 * (i + 1)) ** 0.5)
        self.norm.reset_parameters()
        std = self.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def _expect(exc_type, fn, *words):
    try:
        fn()
    except exc_type as exc:
        assert all(w in str(exc) for w in words), str(exc)
        return
    raise AssertionError(f"expected {exc_type.__name__}")


def titan_recipe(rank, ws, kind, swap):
    """meta -> fully_shard(blocks, root) -> to_empty -> init_weights, then the first forward and
    two SGD steps in parity with an unsharded copy of the initialised weights."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = TitanLike()
        mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",))
        placements = getattr(mfsdp.Placements, kind)("dp")
        for layer in model.layers.values():
            mfsdp.fully_shard(layer, mesh, placements)
        mfsdp.fully_shard(model, mesh, placements)
        names = [n for n, _ in model.named_parameters()]
        ids = [id(p) for p in model.parameters()]
        assert model.to_empty(device="cpu") is model
        assert [n for n, _ in model.named_parameters()] == names  # same names, same order ...
        assert [id(p) for p in model.parameters()] == ids  # ... and the same (sharded) objects
        assert not model.freqs_cis.is_meta and model.freqs_cis.dtype == torch.complex64
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DTensor: "random operators may not have complete support on cpu"
            model.init_weights()
        assert torch.equal(model.freqs_cis, TitanLike(max_seq=32)._precompute_freqs_cis())
        # Conversions that would move or cast the shards are refused, with the way out.
        _expect(RuntimeError, lambda: model.to(torch.bfloat16), "cannot do in place", "MixedPrecisionPolicy")
        _expect(RuntimeError, lambda: model.to_empty(device="meta"), "to_empty(device='cpu')")
        assert model.to("cpu") is model and model.float() is model  # no-ops are fine
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)

    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    assert float(full["layers.0.wq.weight"].abs().max()) > 0 and float(full["norm.weight"].min()) == 1.0
    ref = TitanLike()
    ref.load_state_dict(full)
    x, y = global_batch(0, 2 * ws, 8, 67)
    with torch.no_grad():
        torch.testing.assert_close(model(x.chunk(ws)[rank]), ref(x.chunk(ws)[rank]), rtol=1e-5, atol=1e-6)
    optim = mfsdp.fully_shard_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.5))
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        x, y = global_batch(step, 2 * ws, 8, 67)
        loss_fn(ref(x), y).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        loss_fn(model(x.chunk(ws)[rank]), y.chunk(ws)[rank]).backward()
        optim.step()  # steps the DTensors kept by to_empty: views of the flat shards
        optim.zero_grad()
    worst = max(float((p.full_tensor() - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    return worst


@pytest.mark.parametrize("kind, swap", [("zero3", False), ("zero2", False), ("zero3", True)])
def test_fsdp2_recipe_meta_fully_shard_to_empty_init_weights(world, kind, swap):
    """The torchtitan recipe on an mfsdp model: to_empty keeps the shards (with and without
    torch's swap-on-conversion flag), materialises and the model's init_weights rebuilds the
    buffer, nn.init (normal_, trunc_normal_, ones_) writes through the DTensors, and the first
    forward (zero2: from a refreshed persistent copy) and two steps match an unsharded model."""
    assert max(world(2).run(titan_recipe, kind=kind, swap=swap)) < 1e-5

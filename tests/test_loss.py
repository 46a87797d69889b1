"""mfsdp.models.loss: the fused head + cross-entropy against the plain path, on CPU.

Parity is of the loss sum, the count and both gradients (hidden and weight) against
``cross_entropy_sum(F.linear(h, w), labels)``, which is ``F.cross_entropy(..., reduction="sum")``
on the fp32 logits. The memory test watches every tensor the ops create, so it does not depend on
timing or on the allocator.
"""

from __future__ import annotations

import importlib.util
import json
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mfsdp import _compat
from mfsdp.models.loss import CHUNK_LOGITS_BYTES, cross_entropy_sum, default_chunk_tokens, linear_cross_entropy

ROOT = Path(__file__).resolve().parents[1]
B, S, D, V = 2, 24, 16, 257  # N = 48 tokens


def make_inputs(dtype=torch.float32, ignored_every=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, D, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=gen) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=gen)
    if ignored_every:
        labels.view(-1)[3::ignored_every] = -100  # scattered across both sequences
    return hidden, weight, labels


def loss_and_grads(loss_fn, hidden, weight, labels, scale=1.0, **kwargs):
    """The (sum, count) of ``loss_fn`` and the gradients of ``sum / scale`` w.r.t. hidden and weight."""
    loss, count = loss_fn(hidden, weight, labels, **kwargs)
    grad_h, grad_w = torch.autograd.grad(loss / scale, (hidden, weight))
    return loss.detach(), count, grad_h, grad_w


def plain(hidden, weight, labels):
    return cross_entropy_sum(F.linear(hidden, weight), labels)


def assert_rel_close(actual, expected, rtol):
    """Within ``rtol`` of ``expected`` relative to its largest entry, element by element."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = expected.abs().max().clamp(min=1e-30)
    err = float((actual - expected).abs().max() / scale)
    assert err <= rtol, f"relative error {err:.3g} > {rtol:.3g}"


def assert_matches_plain(hidden, weight, labels, scale=1.0, rtol=1e-5, **kwargs):
    got = loss_and_grads(linear_cross_entropy, hidden, weight, labels, scale, **kwargs)
    want = loss_and_grads(plain, hidden, weight, labels, scale)
    assert got[0].dtype == torch.float32 and got[0].dim() == 0
    assert got[1].dtype == torch.int64 and got[1].dim() == 0 and got[1] == want[1]
    for g, w in zip(got[:1] + got[2:], want[:1] + want[2:]):
        assert_rel_close(g, w, rtol)
    return got


@pytest.mark.parametrize("chunk_tokens", [1, 16, 13, 48, 1000, None])  # 13: uneven; 1000 > N
def test_matches_plain_path_fp32(chunk_tokens):
    hidden, weight, labels = make_inputs()
    _, count, grad_h, _ = assert_matches_plain(hidden, weight, labels, chunk_tokens=chunk_tokens)
    assert count == B * S - len(range(3, B * S, 5))
    assert grad_h.shape == (B, S, D)
    ignored = labels == -100
    assert grad_h[ignored].abs().max() == 0  # ignored tokens get no gradient at all


def test_grad_output_scaling_is_honoured():
    """The trainer backprops ``loss_sum / global_count``: both gradients scale with it."""
    hidden, weight, labels = make_inputs()
    assert_matches_plain(hidden, weight, labels, scale=7.0, chunk_tokens=13)
    loss, count = linear_cross_entropy(hidden, weight, labels, chunk_tokens=13)
    grad_1 = torch.autograd.grad(loss, weight, retain_graph=True)[0]
    grad_7 = torch.autograd.grad(loss / 7.0, weight)[0]
    assert_rel_close(grad_7 * 7.0, grad_1, 1e-6)


def test_all_tokens_ignored():
    hidden, weight, labels = make_inputs(ignored_every=0)
    labels.fill_(-100)
    loss, count, grad_h, grad_w = loss_and_grads(linear_cross_entropy, hidden, weight, labels, chunk_tokens=13)
    assert loss == 0 and count == 0
    assert grad_h.abs().max() == 0 and grad_w.abs().max() == 0
    ref_loss, ref_count = plain(hidden, weight, labels)
    assert ref_loss == 0 and ref_count == 0  # the plain path's sum is 0 too (a mean would be NaN)


def test_flat_and_custom_ignore_index():
    hidden, weight, labels = make_inputs()
    labels = torch.where(labels == -100, 5, labels)
    labels.view(-1)[::4] = 5  # the class 5 is also the ignored value: it is not counted either
    got = linear_cross_entropy(hidden.reshape(-1, D), weight, labels.reshape(-1), ignore_index=5, chunk_tokens=10)
    want = F.cross_entropy(F.linear(hidden, weight).reshape(-1, V), labels.reshape(-1), ignore_index=5,
                           reduction="sum")
    assert_rel_close(got[0].detach(), want.detach(), 1e-5)
    assert got[1] == (labels != 5).sum()


def test_tied_embedding_gradients_add():
    """The head's weight is also the embedding table: its gradient is the sum of both uses."""
    gen = torch.Generator().manual_seed(1)
    table = (torch.randn(V, D, generator=gen) * 0.3).requires_grad_()
    mix = (torch.randn(D, D, generator=gen) / D ** 0.5).requires_grad_()
    tokens = torch.randint(0, V, (B, S), generator=gen)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100

    def grads(loss_fn):
        hidden = torch.tanh(F.embedding(tokens, table) @ mix)
        loss, count = loss_fn(hidden, table, labels)
        return (loss.detach(), *torch.autograd.grad(loss / count, (table, mix)))

    got = grads(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=11))
    want = grads(plain)
    for g, w in zip(got, want):
        assert_rel_close(g, w, 1e-5)


def test_bf16_close_to_fp32_reference():
    """bf16 against the fp32 computation on the same (bf16-rounded) inputs.

    The tolerance is 2e-2 of the relative norm. bf16 keeps 8 significant bits, so one rounding
    costs about 2^-9 = 2e-3. The logits, the softmax gradient and each GEMM's output round once or
    twice, so a correct gradient lies a few 1e-3 off. A wrong one lies far outside: a dropped
    chunk, a missing one-hot, an unscaled ``grad_output`` or an unmasked ignored row moves a
    gradient by 10% or more. The fused path must also be about as close as the plain bf16 path
    it replaces.
    """
    hidden, weight, labels = make_inputs(torch.bfloat16)
    got = loss_and_grads(linear_cross_entropy, hidden, weight, labels, scale=3.0, chunk_tokens=13)
    bf16_plain = loss_and_grads(plain, hidden, weight, labels, scale=3.0)
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    ref = loss_and_grads(plain, h32, w32, labels, scale=3.0)
    assert got[2].dtype == got[3].dtype == torch.bfloat16 and got[0].dtype == torch.float32
    for name, g, p, r in zip(("loss", "count", "grad_hidden", "grad_weight"), got, bf16_plain, ref):
        if name == "count":
            assert g == r
            continue
        err = float((g.float() - r).norm() / r.norm())
        plain_err = float((p.float() - r).norm() / r.norm())
        assert err < 2e-2, (name, err)
        assert err < 3 * plain_err + 2e-3, (name, err, plain_err)


class CreatedTensors(_compat.dispatch_mode_base()):
    """The largest tensor of each dtype that an op creates (views and in-place results are not new),
    the peak of their live bytes, and how many matrix products ran."""

    MATMULS = {"mm", "addmm", "addmm_"}

    def __init__(self) -> None:
        super().__init__()
        self.largest: dict[torch.dtype, int] = {}
        self.live: dict[int, int] = {}
        self.peak = 0
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.matmuls += func.overloadpacket.__name__ in self.MATMULS
        leaves = _compat.tree_flatten((args, kwargs))[0]
        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        for t in _compat.tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in inputs and key not in self.live:
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), t.numel())
                self.live[key] = storage.nbytes()
                weakref.finalize(storage, self.live.pop, key, None)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def watched(loss_fn, hidden, weight, labels) -> CreatedTensors:
    mode = CreatedTensors()
    with mode:
        loss, count = loss_fn(hidden, weight, labels)
        (loss / count).backward()
    return mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tensor_holds_more_than_one_chunk_of_logits(dtype):
    """No tensor of N x V elements is made, in the forward or the backward: the largest is one
    chunk's logits. D < chunk keeps the V x D weight gradient below that bound, so the bound is
    the logits' own. The peak of live bytes grows with the token count only by N x D terms (the
    hidden gradient), where the plain path's grows by several N x V. The same watch on the plain
    path sees the whole (N, V) logits, so the test can fail."""
    chunk, fused, unfused = 20, {}, {}
    for batch in (B, 4 * B):
        gen = torch.Generator().manual_seed(batch)
        hidden = torch.randn(batch, S, D, generator=gen).to(dtype).requires_grad_()
        weight = (torch.randn(V, D, generator=gen) * 0.3).to(dtype).requires_grad_()
        labels = torch.randint(0, V, (batch, S), generator=gen)
        fused[batch] = watched(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=chunk),
                               hidden, weight, labels)
        unfused[batch] = watched(plain, hidden, weight, labels)
        assert fused[batch].largest[torch.float32] == chunk * V
        assert max(fused[batch].largest.values()) == chunk * V
        assert unfused[batch].largest[torch.float32] >= batch * S * V
    more_tokens = 3 * B * S
    assert fused[4 * B].peak - fused[B].peak <= 3 * more_tokens * D * 4
    assert unfused[4 * B].peak - unfused[B].peak >= 2 * more_tokens * V * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [True, False])
def test_one_chunk_of_logits_is_live_at_a_time(dtype, grad):
    """A chunk's logits go before the next chunk's GEMM makes its own: the peak of live bytes is one
    chunk's logits and fp32 log-probabilities (in bf16 also log_softmax's passing fp32 upcast) above
    the head's gradients it holds, in training and under no_grad; a chunk's logits held one chunk too
    long exceed the bound."""
    chunk, size = 16, torch.finfo(dtype).bits // 8  # 3 chunks of the 48 tokens
    hidden, weight, labels = make_inputs(dtype)
    with torch.set_grad_enabled(grad), CreatedTensors() as mode:
        loss, count = linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
        if grad:
            (loss / count).backward()
    logits = chunk * V * (size + 4 + (4 if dtype == torch.bfloat16 else 0))
    gradients = (V * D + B * S * D) * size if grad else 0
    assert logits + gradients <= mode.peak + chunk * V * size // 2  # the bound is tight ...
    assert mode.peak <= logits + gradients + chunk * V * size // 2, (mode.peak, logits, gradients)  # ... and holds


def test_no_grad_runs_only_the_logits_products():
    """Under no_grad (evaluation) only the logits GEMM runs; with a frozen hidden, two per chunk."""
    hidden, weight, labels = make_inputs()
    chunks = -(-B * S // 13)
    with torch.no_grad(), CreatedTensors() as mode:
        loss, _ = linear_cross_entropy(hidden, weight, labels, chunk_tokens=13)
    assert mode.matmuls == chunks
    assert_rel_close(loss, plain(hidden, weight, labels)[0].detach(), 1e-5)
    with CreatedTensors() as mode:
        loss, _ = linear_cross_entropy(hidden.detach(), weight, labels, chunk_tokens=13)
    assert mode.matmuls == 2 * chunks
    (grad_w,) = torch.autograd.grad(loss, weight)
    assert_rel_close(grad_w, torch.autograd.grad(plain(hidden.detach(), weight, labels)[0], weight)[0], 1e-5)


def test_torch_compile_traces_it_whole():
    """fullgraph=True fails on any graph break. aot_eager keeps the test fast: it runs dynamo and
    AOT autograd (the tracing a GPU's inductor gets too) without generating kernels."""
    hidden, weight, labels = make_inputs()
    compiled = torch.compile(lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=13),
                             fullgraph=True, backend="aot_eager")
    got = loss_and_grads(compiled, hidden, weight, labels, scale=7.0)
    want = loss_and_grads(plain, hidden, weight, labels, scale=7.0)
    assert got[1] == want[1]
    for g, w in zip(got[:1] + got[2:], want[:1] + want[2:]):
        assert_rel_close(g, w, 1e-5)


def test_default_chunk_fits_the_logits_budget():
    assert default_chunk_tokens(128256) == 2048
    assert 2048 * 128256 * 4 <= CHUNK_LOGITS_BYTES
    assert default_chunk_tokens(300) * 300 * 4 <= CHUNK_LOGITS_BYTES
    assert default_chunk_tokens(CHUNK_LOGITS_BYTES) == 1  # a vocabulary beyond the budget: one token


def test_rejects_mismatched_inputs():
    hidden, weight, labels = make_inputs()
    with pytest.raises(ValueError, match="do not match hidden"):
        linear_cross_entropy(hidden, weight, labels.reshape(-1))
    with pytest.raises(ValueError, match="pass both in the compute dtype"):
        linear_cross_entropy(hidden, weight.detach().double(), labels)
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        linear_cross_entropy(hidden, weight, labels, chunk_tokens=0)


def test_loss_bench_cpu_smoke(tmp_path, capsys):
    """benchmarks/loss_bench.py --cpu-smoke, in process: every variant runs, agrees with the plain
    path, and writes one JSON line per variant and shape."""
    spec = importlib.util.spec_from_file_location("loss_bench", ROOT / "benchmarks" / "loss_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "loss_bench.jsonl"
    records = bench.main(["--cpu-smoke", "--out", str(out)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == records
    assert [(r["tokens"], r["variant"]) for r in records] == [(n, v) for n in (40,) for v in bench.VARIANTS]
    for r in records:
        assert r["status"] == "ok", r
        assert r["ms_median"] > 0 and r["peak_gib"] is None  # no CUDA peak on CPU
        assert r["loss_rel_diff"] < 1e-5 and r["grad_hidden_rel_diff"] < 1e-5 and r["grad_weight_rel_diff"] < 1e-5
    assert len(capsys.readouterr().out.splitlines()) == len(records)

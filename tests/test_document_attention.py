"""Packed samples in the bundled Llama: document-causal attention, restarting positions, and the
labels path that returns (loss sum, token count). CPU, fp32; the CPU mask is SDPA's boolean one
(flex_attention has no CPU backward), checked against eager flex_attention forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mfsdp.models import Llama, build_model, get_config, plain_linear_cross_entropy
from mfsdp.models.document_mask import document_mask

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]

CFG = get_config("tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=97,
                 max_seq_len=32)


def _model(cfg=CFG, seed=0) -> Llama:
    model = build_model(cfg)
    model.init_weights(seed=seed)
    return model


def _sample(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


def _pack(*samples: torch.Tensor):
    """One row: tokens, positions restarting at 0 per sample, document ids 0, 1, ..."""
    tokens = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    documents = torch.cat([torch.full((len(s),), i) for i, s in enumerate(samples)])[None]
    return tokens, positions, documents


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("first", [True, False])
def test_a_sample_does_not_see_the_samples_packed_with_it(first):
    model = _model()
    a, b, c = _sample(7, 1), _sample(9, 2), _sample(13, 3)
    with torch.no_grad():
        alone = model(a[None])[0]
        for other in (b, c):
            tokens, positions, documents = _pack(a, other) if first else _pack(other, a)
            logits = model(tokens, positions=positions, document_ids=documents)[0]
            got = logits[:len(a)] if first else logits[len(other):]
            assert _rel(got, alone) < 1e-5
    # The loss over A's tokens alone (labels -100 elsewhere) is A's loss, packed either way.
    labels = torch.full((1, len(a) + len(c)), -100)
    tokens, positions, documents = _pack(c, a)
    labels[0, len(c):-1] = a[1:]
    packed_loss, packed_count = model(tokens, positions=positions, document_ids=documents, labels=labels)
    alone_labels = torch.cat([a[1:], torch.tensor([-100])])[None]
    loss, count = model(a[None], labels=alone_labels)
    assert int(packed_count) == int(count) == len(a) - 1
    assert abs(float(packed_loss) - float(loss)) < 1e-5 * float(loss)


def test_positions_index_the_rotary_tables():
    model = _model()
    tokens, positions, documents = _pack(_sample(5, 1), _sample(11, 2))
    seen = {}
    model.layers[0].register_forward_pre_hook(lambda m, args: seen.update(cos=args[1], sin=args[2]))
    with torch.no_grad():
        model(tokens, positions=positions, document_ids=documents)
    assert seen["cos"].shape == (1, 16, CFG.head_dim // 2)
    assert torch.equal(seen["cos"], model.rope_cos[positions]) and torch.equal(seen["sin"], model.rope_sin[positions])
    assert torch.equal(seen["cos"][0, 5], model.rope_cos[0])  # the second document restarts at 0


def test_default_positions_and_one_document_are_the_plain_causal_model():
    model = _model()
    tokens = _sample(20, 4)[None].repeat(2, 1)
    with torch.no_grad():
        plain = model(tokens)
        assert torch.equal(model(tokens, positions=torch.arange(20)[None].repeat(2, 1)), plain)
        one_document = model(tokens, document_ids=torch.zeros_like(tokens))
    assert _rel(one_document, plain) < 1e-6


def test_labels_give_the_cross_entropy_sum_and_count_and_the_same_gradients():
    model = _model()
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(6))
    labels = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    labels[0, :5] = -100
    labels[1, -3:] = -100
    loss, count = model(tokens, labels=labels)
    assert loss.dtype == torch.float32 and loss.ndim == 0 and count.dtype == torch.int64
    assert int(count) == 32 - 8
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    reference.backward()
    assert abs(float(loss) - float(reference)) < 1e-6 * float(reference)
    for n, p in model.named_parameters():
        assert _rel(grads[n], p.grad) < 1e-5, n


def test_the_loss_function_is_swappable_and_gets_the_head_weight():
    model = _model()
    calls = []

    def loss_fn(hidden, weight, labels):
        calls.append((hidden.shape, weight is model.output.weight))
        return plain_linear_cross_entropy(hidden, weight, labels)

    model.loss_fn = loss_fn
    tokens = _sample(12, 8)[None]
    model(tokens, labels=tokens)
    assert calls == [(torch.Size([1, 12, CFG.dim]), True)]


def test_flex_attention_forward_matches_the_boolean_mask():
    """The CUDA path's BlockMask and flex_attention (grouped heads as they are) against the CPU one,
    forward only: CPU flex_attention has no backward."""
    model = _model()
    tokens, positions, documents = _pack(_sample(6, 1), _sample(3, 2), _sample(15, 3))
    tokens, positions, documents = (t.repeat(2, 1) for t in (tokens, positions, documents))
    documents[1] = torch.arange(24) // 8  # another split in the second row
    assert isinstance(document_mask(documents, "sdpa"), torch.Tensor)
    with torch.no_grad():
        sdpa = model(tokens, positions=positions, document_ids=documents)
        model.document_mask_backend = "flex"
        flex = model(tokens, positions=positions, document_ids=documents)
    assert _rel(flex, sdpa) < 1e-5


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_with_documents(reentrant):
    tokens, positions, documents = _pack(_sample(9, 1), _sample(7, 2))
    grads = []
    for checkpointing in (False, True):
        model = _model()
        model.set_activation_checkpointing(checkpointing, reentrant=reentrant)
        loss, count = model(tokens, positions=positions, document_ids=documents, labels=tokens)
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n in grads[0]:
        assert _rel(grads[1][n], grads[0][n]) < 1e-6, n


def test_mixture_of_experts_takes_documents_and_labels():
    cfg = get_config("moe-tiny", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40, vocab_size=61,
                     max_seq_len=32)
    model = _model(cfg)
    tokens, positions, documents = _pack(_sample(5, 1) % 61, _sample(9, 2) % 61)
    loss, count = model(tokens, positions=positions, document_ids=documents, labels=tokens)
    (loss / count + cfg.moe_aux_loss_coef * model.aux_loss()).backward()
    assert int(count) == 14 and model.layers[0].feed_forward.router.weight.grad is not None


def test_compiled_block_takes_the_document_mask_without_recompiling():
    """Inductor on CPU: blocks compiled as ``parallelize(compile=True)`` does, given the mask as an
    argument; a second batch of other documents (same shape) runs without recompiling. About 30 s
    on an idle CPU core, mostly inductor's first compile."""
    torch.compiler.reset()
    eager, compiled = _model(), _model()
    for block in compiled.layers:
        block.compile()

    def step(split: int) -> None:
        tokens, positions, documents = _pack(_sample(split, split), _sample(20 - split, split + 1))
        losses = []
        for model in (eager, compiled):
            loss, _ = model(tokens, positions=positions, document_ids=documents, labels=tokens)
            loss.backward()
            losses.append(loss)
        assert abs(float(losses[1]) - float(losses[0])) < 1e-5 * float(losses[0])
        for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
            assert _rel(q.grad, p.grad) < 1e-5, n

    step(5)
    with torch.compiler.set_stance("fail_on_recompile"):  # other documents reuse the graphs
        step(11)

"""The Llama model and its FLOP accounting, on one CPU process."""

import dataclasses

import pytest
import torch

from mfsdp.models.flops import flops_per_token, mfu, param_counts, peak_flops
from mfsdp.models.llama import PRESETS, Llama, LlamaConfig, get_config

pytestmark = pytest.mark.timeout(120)

SMALL = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                    vocab_size=97, max_seq_len=32)


def build(cfg=SMALL, seed=0):
    model = Llama(cfg)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_logits_shape_and_parameter_count_match_the_formula():
    model = build()
    tokens = torch.randint(0, SMALL.vocab_size, (3, 17))
    assert model(tokens).shape == (3, 17, SMALL.vocab_size)
    assert sum(p.numel() for p in model.parameters()) == param_counts(SMALL)["total"]


def test_1b_preset_on_meta_device_has_about_one_and_a_half_billion_untied_parameters():
    cfg = get_config("1b")
    with torch.device("meta"):
        model = Llama(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert total == param_counts(cfg)["total"]
    assert 1.45e9 < total < 1.55e9
    assert model.output.weight is not model.tok_embeddings.weight


def test_8b_preset_count():
    assert 8.0e9 < param_counts(PRESETS["8b"])["total"] < 8.1e9


def test_tied_embeddings_share_one_matrix():
    cfg = dataclasses.replace(SMALL, tie_embeddings=True)
    model = build(cfg)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg)["total"]
    model(torch.randint(0, cfg.vocab_size, (1, 8))).sum().backward()
    assert model.tok_embeddings.weight.grad is not None


def test_future_tokens_do_not_change_earlier_logits():
    model = build()
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % SMALL.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_init_is_deterministic_and_meta_init_matches():
    a, b = build(seed=3), build(seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    with torch.device("meta"):
        meta = Llama(SMALL)
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights(buffer_device="cpu")
    tokens = torch.randint(0, SMALL.vocab_size, (2, 8))
    torch.testing.assert_close(meta(tokens), a(tokens))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_same_loss_and_grads(reentrant):
    tokens = torch.randint(0, SMALL.vocab_size, (2, 12))
    losses, grads = [], []
    for enabled in (False, True):
        model = build()
        model.set_activation_checkpointing(enabled, reentrant=reentrant)
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(plain, recomputed)


def test_bf16_forward_runs():
    model = build().to(torch.bfloat16)
    logits = model(torch.randint(0, SMALL.vocab_size, (1, 8)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_flops_formula_value():
    cfg = get_config("1b")
    counts = param_counts(cfg)
    assert counts["embedding"] == 128256 * 2048
    assert counts["non_embedding"] == counts["total"] - counts["embedding"]
    expected = 6 * counts["non_embedding"] + 12 * 16 * 2048 * 4096
    assert flops_per_token(cfg, 4096) == expected
    # SMALL by hand: per block attention 4*64*64 - 2*64*32 ... written out in full.
    per_block = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    non_embedding = 2 * per_block + 64 + 97 * 64
    assert flops_per_token(SMALL, 32) == 6 * non_embedding + 12 * 2 * 64 * 32


def test_peak_flops_and_mfu():
    assert peak_flops("cpu") is None
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    cfg = get_config("1b")
    value = mfu(10_000, cfg, 4096, "NVIDIA H200")
    assert value == pytest.approx(10_000 * flops_per_token(cfg, 4096) / 989e12)
    assert mfu(10_000, cfg, 4096, "cpu") is None


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="known presets: tiny, 1b, 8b, 70b"):
        get_config("13b")
    with pytest.raises(ValueError, match="must divide dim"):
        LlamaConfig(dim=100, n_layers=1, n_heads=3, n_kv_heads=1, ffn_dim=8, vocab_size=8)
    with pytest.raises(ValueError, match="must divide n_heads"):
        LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=3, ffn_dim=8, vocab_size=8)
    with pytest.raises(ValueError, match="unknown LlamaConfig field"):
        get_config("tiny", width=3)
    assert get_config("tiny", n_layers=2).n_layers == 2

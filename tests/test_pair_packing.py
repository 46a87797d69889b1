"""Preference pairs in windows: the packed shared-prompt layout on the bundled tiny Llama and the
padded layout on a tiny HF Llama give each answer the log-probs it has after its prompt alone;
the branch mask against a brute-force one. CPU, fp32."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from mfsdp.data.packing import PackedSampler
from mfsdp.data.pair_packing import CHOSEN, PROMPT, REJECTED, PairWindows, pair_lengths
from mfsdp.data.token_file import DataError
from mfsdp.models import build_model, get_config
from mfsdp.models.answer_logps import answer_logps
from mfsdp.models.document_mask import document_mask

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]

VOCAB = 97
CFG = get_config("tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=VOCAB,
                 max_seq_len=64)


def _pairs(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, VOCAB, (int(torch.randint(low, high, (), generator=g)),), generator=g)
                  for low, high in ((1, 8), (1, 9), (1, 9))) for _ in range(count)]


def _file(pairs) -> SimpleNamespace:
    """A stand-in for a version-3 token file: pairs stored [prompt | chosen | rejected], the
    per-token byte the segment."""
    tokens = torch.cat([torch.cat(p) for p in pairs])
    segments = torch.cat([torch.full((len(part),), s, dtype=torch.uint8) for p in pairs
                          for s, part in enumerate(p)])
    lengths = torch.tensor([sum(len(part) for part in p) for p in pairs])
    return SimpleNamespace(path=Path("pairs.tokens"), segments=segments, is_pairs=True, sample_lengths=lengths,
                           sample_starts=torch.cumsum(lengths, 0) - lengths, num_samples=len(pairs),
                           take=lambda index: tokens[index].to(torch.int64))


def _alone(model_logits, pairs) -> torch.Tensor:
    """(pairs, 2): each answer's summed log-probs after its prompt alone, unpacked, unpadded."""
    out = []
    for prompt, *answers in pairs:
        for answer in answers:
            sequence = torch.cat([prompt, answer])
            logps = torch.log_softmax(model_logits(sequence[None])[0].float(), -1)
            out.append(logps[len(prompt) - 1:-1].gather(1, answer[:, None]).sum())
    return torch.stack(out).view(-1, 2)


def test_the_branch_mask_is_the_brute_force_rule_and_flex_computes_the_same():
    g = torch.Generator().manual_seed(0)
    documents = torch.sort(torch.randint(0, 3, (2, 24), generator=g), dim=1).values
    branches = torch.randint(0, 3, (2, 24), generator=g)
    mask = document_mask(documents, "sdpa", branches)
    for b in range(2):
        for q in range(24):
            for k in range(24):
                allowed = (k <= q and bool(documents[b, q] == documents[b, k])
                           and int(branches[b, k]) in (0, int(branches[b, q])))
                assert bool(mask[b, 0, q, k]) == allowed, (b, q, k)
    q, k, v = (torch.randn(2, 2, 24, 8, generator=g) for _ in range(3))
    flex = flex_attention(q, k, v, block_mask=document_mask(documents, "flex", branches))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
    assert torch.equal(document_mask(documents, "sdpa"), document_mask(documents, "sdpa", torch.zeros_like(branches)))


def test_packed_pairs_give_each_answer_its_log_probs_after_its_prompt_alone():
    pairs = _pairs(7, seed=1)
    windows = PairWindows(_file(pairs), seq_len=48)
    assert len(windows) < len(pairs) // 2  # several pairs share a window
    model = build_model(CFG)
    model.init_weights(seed=0)
    batch = windows.batch(list(range(len(windows))))
    order = batch.pair_ids.tolist()
    with torch.no_grad():
        logits = model(batch.inputs, positions=batch.positions, document_ids=batch.document_ids,
                       branch_ids=batch.branch_ids)
        got = answer_logps(logits, batch.answers, len(order))
        want = _alone(model, [pairs[i] for i in order])
    torch.testing.assert_close(torch.stack([got.chosen, got.rejected], 1), want, rtol=1e-5, atol=1e-5)
    assert got.chosen_tokens.tolist() == [len(pairs[i][CHOSEN]) for i in order]
    assert got.rejected_tokens.tolist() == [len(pairs[i][REJECTED]) for i in order]
    # The rejected answer's positions continue from the prompt's end; its branch is 2.
    first = order[0]
    prompt, chosen, rejected = (len(part) for part in pairs[first])
    row = batch.positions[0, :prompt + chosen + rejected]
    assert row[prompt + chosen:].tolist() == list(range(prompt, prompt + rejected))
    assert batch.branch_ids[0, :prompt + chosen + rejected].tolist() == [0] * prompt + [1] * chosen + [2] * rejected
    assert (batch.targets == -100).all()


def test_padded_pairs_on_a_hf_llama_give_each_answer_its_log_probs_after_its_prompt_alone():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    pairs = _pairs(5, seed=2)
    windows = PairWindows(_file(pairs), seq_len=20, packed=False)
    assert len(windows) == len(pairs)
    batch = windows.batch([3, None, 0, 4])
    order = batch.pair_ids.tolist()
    longest = max(len(pairs[i][PROMPT]) + max(len(pairs[i][CHOSEN]), len(pairs[i][REJECTED])) for i in order)
    assert batch.inputs.shape == (8, longest) and batch.positions is None and batch.branch_ids is None
    assert order == windows.samples_of(3).tolist() + windows.samples_of(0).tolist() + windows.samples_of(4).tolist()
    with torch.no_grad():  # right padding under a causal mask changes no real token: no attention mask
        got = answer_logps(model(batch.inputs).logits, batch.answers, len(order))
        want = _alone(lambda ids: model(ids).logits, [pairs[i] for i in order])
    torch.testing.assert_close(torch.stack([got.chosen, got.rejected], 1), want, rtol=1e-5, atol=1e-5)
    # trl's stacking: the chosen rows first, then the rejected rows, in the same order.
    prompt, chosen, _ = (len(part) for part in pairs[order[0]])
    assert torch.equal(batch.inputs[0, :prompt + chosen], torch.cat(pairs[order[0]][:2]))
    assert torch.equal(batch.inputs[4, :prompt], pairs[order[0]][PROMPT])


def test_a_pair_longer_than_a_window_is_one_line_naming_it_and_both_fixes():
    pairs = _pairs(4, seed=3)
    lengths = pair_lengths(_file(pairs))
    longest = int(torch.argmax(lengths.sum(1)))
    with pytest.raises(DataError) as caught:
        PairWindows(_file(pairs), seq_len=int(lengths.sum(1).max()) - 1)
    message = str(caught.value)
    assert "\n" not in message and f"pair {longest}," in message
    assert "--data.seq_len" in message and "--data.max_len" in message
    bad = _file(pairs)
    bad.segments = bad.segments.flip(0)  # rejected before chosen
    with pytest.raises(DataError, match="does not hold preference pairs"):
        pair_lengths(bad)


def test_the_sampler_draws_every_pair_once_an_epoch_and_counts_pairs():
    data = _file(_pairs(9, seed=4))
    windows = PairWindows(data, 32, range(8))
    ranks = [PackedSampler(data, 32, local_batch=1, rank=r, world_size=2, windows=windows) for r in range(2)]
    assert sorted(ranks[0].epoch_samples(0).tolist()) == list(range(8))
    drawn = []
    for step in range(1, ranks[0].steps_per_epoch + 1):
        pair_ids = [sampler.batch(step).pair_ids for sampler in ranks]
        assert sum(ids.numel() for ids in pair_ids) == ranks[0].loss_tokens(step)  # pairs, not tokens
        drawn += torch.cat(pair_ids).tolist()
    assert sorted(drawn) == list(range(8))
    empty = windows.batch([None])  # the top-up of an epoch's last step: no pair, no answer
    assert empty.answers.shape == (3, 0) and empty.pair_ids.numel() == 0

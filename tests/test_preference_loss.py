"""The preference losses against trl 1.16's own loss code on random per-pair log-probs.

trl's DPO losses live inside ``DPOTrainer._compute_loss``, which needs a model; it is called here
as an unbound function with a stub ``self`` (the config fields) and a stub model whose per-token
log-probs are random, with the reference log-probs precomputed (``ref_chosen_logps``). SimPO and
the label-smoothed (conservative) sigmoid are checked against ``CPOTrainer.cpo_loss``, callable
with a stub ``self`` as it is. CPU, fp32.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from mfsdp.models.answer_logps import PairLogps
from mfsdp.models.preference_loss import LOSS_TYPES, PreferenceLoss, pair_metrics

DPOTrainer = pytest.importorskip("trl.trainer.dpo_trainer").DPOTrainer
CPOTrainer = pytest.importorskip("trl.experimental.cpo.cpo_trainer").CPOTrainer

PAIRS, WIDTH = 6, 12


def _case(seed: int = 0):
    """Per-token policy log-probs of [chosen rows; rejected rows] with a completion mask (each
    prompt at least 1 token), and random reference sums."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 4, (2 * PAIRS,), generator=g)
    answer = torch.randint(1, WIDTH - 4, (2 * PAIRS,), generator=g)
    columns = torch.arange(WIDTH)
    completion = ((columns >= prompt[:, None]) & (columns < (prompt + answer)[:, None])).long()
    per_token = -torch.rand(2 * PAIRS, WIDTH - 1, generator=g) * 3 * completion[:, 1:]
    sums, counts = per_token.sum(1), completion.sum(1)
    policy = PairLogps(sums[:PAIRS], sums[PAIRS:], counts[:PAIRS], counts[PAIRS:])
    ref = sums + torch.randn(2 * PAIRS, generator=g) * 2
    reference = PairLogps(ref[:PAIRS], ref[PAIRS:], counts[:PAIRS], counts[PAIRS:])
    return per_token, completion, policy, reference


def _trl_dpo(per_token, completion, reference: PairLogps, loss: PreferenceLoss):
    """trl's loss and logged metrics on these log-probs."""
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True), aux_loss_enabled=False, ld_alpha=None,
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x),
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=list(loss.loss_type),
        loss_weights=list(loss.loss_weights or [1.0] * len(loss.loss_type)), beta=loss.beta,
        label_smoothing=loss.label_smoothing, use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1, args=SimpleNamespace())
    zeros = torch.zeros_like(per_token)
    outputs = SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
    inputs = {"input_ids": torch.zeros_like(completion), "attention_mask": torch.ones_like(completion),
              "completion_mask": completion, "ref_chosen_logps": reference.chosen,
              "ref_rejected_logps": reference.rejected}
    value = DPOTrainer._compute_loss(stub, lambda **kwargs: outputs, inputs, False)
    return value, {name: values[0] for name, values in stub._metrics["train"].items()}


def _rows(per_token, completion, pairs):
    rows = torch.cat([pairs, pairs + PAIRS])
    return per_token[rows], completion[rows]


@pytest.mark.parametrize("name", ["sigmoid", "hinge", "ipo"])
def test_each_pair_loss_and_the_rewards_match_trl_dpo(name):
    per_token, completion, policy, reference = _case(1)
    loss = PreferenceLoss(beta=0.3, loss_type=(name,))
    ours = loss(policy, reference)
    for pair in range(PAIRS):  # one pair at a time: trl returns only the batch mean
        one = torch.tensor([pair])
        value, _ = _trl_dpo(*_rows(per_token, completion, one), PairLogps(*(t[one] for t in reference)), loss)
        torch.testing.assert_close(ours.losses[pair], value, rtol=1e-6, atol=1e-6)
    _, metrics = _trl_dpo(per_token, completion, reference, loss)
    ours_metrics = pair_metrics(policy, ours)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                "logps/chosen", "logps/rejected"):
        assert abs(float(ours_metrics[key].mean()) - metrics[key]) < 1e-6 * max(1.0, abs(metrics[key])), key


def test_a_weighted_list_with_sft_matches_trl_dpo():
    per_token, completion, policy, reference = _case(2)
    loss = PreferenceLoss(beta=0.1, loss_type=("sigmoid", "sft", "ipo"), loss_weights=(0.8, 0.2, 1.0))
    value, _ = _trl_dpo(per_token, completion, reference, loss)
    torch.testing.assert_close(loss(policy, reference).losses.mean(), value, rtol=1e-6, atol=1e-6)
    sft = PreferenceLoss(loss_type=("sft",))
    value, _ = _trl_dpo(per_token, completion, reference, sft)  # a mean over all chosen tokens
    torch.testing.assert_close(sft(policy, reference).losses.mean(), value, rtol=1e-6, atol=1e-6)
    # Split in two halves, each divided by the whole batch's chosen tokens per pair: the sum of
    # the halves' per-pair losses over all pairs is the whole batch's.
    per_pair = policy.chosen_tokens.sum() / PAIRS
    halves = [sft(PairLogps(*(t[part] for t in policy)), PairLogps(*(t[part] for t in reference)),
                  chosen_tokens_per_pair=per_pair).losses.sum() for part in (slice(0, 2), slice(2, None))]
    torch.testing.assert_close(sum(halves) / PAIRS, value, rtol=1e-6, atol=1e-6)


def _cpo(chosen, rejected, loss_type: str, loss: PreferenceLoss):
    stub = SimpleNamespace(alpha=0.0, accelerator=SimpleNamespace(device=torch.device("cpu")), beta=loss.beta,
                           loss_type=loss_type, simpo_gamma=loss.simpo_gamma, label_smoothing=loss.label_smoothing)
    return CPOTrainer.cpo_loss(stub, chosen, rejected)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_simpo_matches_trl_cpo_with_its_per_token_means_and_rewards(label_smoothing):
    _, _, policy, _ = _case(3)
    loss = PreferenceLoss(beta=2.0, loss_type=("simpo",), simpo_gamma=0.5, label_smoothing=label_smoothing)
    assert not loss.needs_reference
    ours = loss(policy)
    # CPO's get_batch_logps(average_log_prob=True): each answer's sum over its token count.
    losses, chosen, rejected = _cpo(policy.chosen / policy.chosen_tokens,
                                    policy.rejected / policy.rejected_tokens, "simpo", loss)
    for got, want in zip(ours, (losses, chosen, rejected)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_label_smoothed_sigmoid_is_conservative_dpo_as_trl_cpo_computes_it():
    _, _, policy, reference = _case(4)
    loss = PreferenceLoss(beta=0.2, label_smoothing=0.1)
    # CPO's sigmoid takes chosen - rejected of what it is given: give it the log-ratios.
    losses, _, _ = _cpo(policy.chosen - reference.chosen, policy.rejected - reference.rejected, "sigmoid", loss)
    torch.testing.assert_close(loss(policy, reference).losses, losses, rtol=1e-6, atol=1e-6)


def test_bad_settings_say_what_is_known():
    with pytest.raises(ValueError, match="unknown dpo loss_type 'kto'; known: " + ", ".join(LOSS_TYPES)):
        PreferenceLoss(loss_type=("sigmoid", "kto"))
    with pytest.raises(ValueError, match="loss_weights has 1 values for 2 loss types"):
        PreferenceLoss(loss_type=("sigmoid", "sft"), loss_weights=(1.0,))
    _, _, policy, _ = _case(5)
    with pytest.raises(ValueError, match="needs the reference"):
        PreferenceLoss(loss_type=("sft",))(policy)
    assert not PreferenceLoss(loss_type=("simpo", "sft")).needs_reference

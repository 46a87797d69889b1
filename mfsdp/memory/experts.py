"""Expert parallelism in the memory plan (``mfsdp.experts``): the experts split over ``ep`` ranks, their
dispatch buffers, and the worst case of routing the plan assumes.

Model state. Each MoE layer's experts module is its own unit, as ``apply_expert_parallel`` makes it:
its stacked weights hold ``E / ep`` experts on a rank (``[E / ep, ...]``), sharded over the
``dp_shard / ep`` ranks left (``expert_placements`` over ``([dp_replicate,] ep_shard)``); every other
parameter is sharded over ``dp_shard`` as without EP. The runtime's own layout code sizes both
(``model_state.describe_units`` with the experts' ``Levels``).

Activations. The no-EP measurement routes uniformly: each rank's experts compute its own ``T x K``
(token, slot) rows. With EP a rank's experts compute the rows every rank of its ep group sends them,
and the plan assumes the worst case, not a balanced router: all of the group's copies that can reach
a rank's experts do (a token sends at most ``min(K, E / ep)`` copies to one rank), ``ep x T x min(K,
E / ep)`` rows. Per MoE layer that adds, in the compute dtype:

* in forward, transient: the dispatch buffers, the rows sent and received there and back,
  ``2 (T K + R) D`` (``R``: the received rows);
* saved for backward: the experts' activations over the extra ``R - T K`` rows, ``D + 4F`` a row (the
  rows, gate and up ``2F``, the product ``F``; ``F``: an expert's width);
* in backward: the same buffers' gradients, plus the saved extra again (and once more, recomputed,
  under activation checkpointing).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

from torch import nn

from mfsdp.experts.parallel import EXPERT_WEIGHTS, describe_split, ep_problem, expert_placements, experts_modules
from mfsdp.memory.activations import ActivationProfile
from mfsdp.mesh import DP_REPLICATE, EP_SHARD
from mfsdp.placement import Placements
from mfsdp.runtime.geometry import Levels

IMBALANCE = ("worst-case routing assumed: every rank of an ep group sends a rank's experts all the (token, slot) "
             "copies they can take, ep x tokens x min(top_k, experts / ep) rows (an upper bound; a balanced "
             "router sends tokens x top_k)")
"""The token imbalance the plan assumes, as the plan says it."""


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
    """A model's experts split over ``ep`` ranks: the shapes the plan needs."""

    ep: int
    num_experts: int
    """Experts per MoE layer."""
    top_k: int
    """Experts per token."""
    dim: int
    """The rows' width (the model's hidden size)."""
    ffn: int
    """One expert's hidden width."""
    layers: int
    """MoE layers."""
    blocks: int
    """Blocks of the model (the activation profile is per block)."""

    def received_rows(self, tokens: int) -> int:
        """The rows a rank's experts compute for ``tokens`` tokens a rank, in the worst case (``IMBALANCE``)."""
        return self.ep * tokens * min(self.top_k, self.num_experts // self.ep)

    def dispatch_bytes(self, tokens: int, itemsize: int) -> int:
        """One MoE layer's dispatch buffers in forward: the rows sent and received, there and back."""
        return 2 * (tokens * self.top_k + self.received_rows(tokens)) * self.dim * itemsize

    def saved_extra_bytes(self, tokens: int, itemsize: int) -> int:
        """What one MoE layer saves for backward beyond the uniform measurement: the experts'
        activations over the extra received rows."""
        return (self.received_rows(tokens) - tokens * self.top_k) * (self.dim + 4 * self.ffn) * itemsize

    def profile(self, acts: ActivationProfile, tokens: int, itemsize: int, checkpointing: bool) -> ActivationProfile:
        """``acts`` (measured without EP, per block) with the dispatch buffers and the worst case's
        extra rows; the saved extra is spread over the blocks (``layers`` of them are MoE)."""
        saved = self.saved_extra_bytes(tokens, itemsize)
        buffers = self.dispatch_bytes(tokens, itemsize)
        return dataclasses.replace(
            acts, block_bytes=acts.block_bytes + (0 if checkpointing else saved * self.layers // self.blocks),
            block_forward_transient=acts.block_forward_transient + buffers + (saved if checkpointing else 0),
            block_backward_peak=acts.block_backward_peak + buffers + saved * (2 if checkpointing else 1))


def experts_of(model: nn.Module) -> list[nn.Module]:
    """Each MoE layer's experts: its stacked experts module (``mfsdp.experts``), or, for a layer that
    keeps one module per expert, the ``nn.ModuleList`` of them (planned as if stacked)."""
    return experts_modules(model) or [m.experts for m in model.modules() if isinstance(
        getattr(m, "experts", None), nn.ModuleList) and len(m.experts) == getattr(m, "num_experts", None)]


def _config(model: nn.Module):
    return getattr(model, "cfg", None) or getattr(model, "config", None)


def _shape(experts: nn.Module, dim: int) -> tuple[int, int]:
    """(experts, an expert's width) of an experts module or list (a SwiGLU: 3 x dim x width weights)."""
    if isinstance(experts, nn.ModuleList):
        return len(experts), sum(p.numel() for p in experts[0].parameters()) // (3 * dim)
    return experts.num_experts, getattr(experts, EXPERT_WEIGHTS[0]).shape[1] // 2


def _keep_local(experts: nn.Module, ep: int) -> None:
    """``experts`` reduced to what one rank holds: the first ``E / ep`` experts (meta tensors)."""
    if isinstance(experts, nn.ModuleList):
        del experts[len(experts) // ep:]
        return
    for name in EXPERT_WEIGHTS:
        full = getattr(experts, name)
        setattr(experts, name, nn.Parameter(full.new_empty((full.shape[0] // ep, *full.shape[1:])),
                                            requires_grad=full.requires_grad))


def split_experts_for_plan(model: nn.Module, units: list, ep: int, dp_shard: int,
                           blocks: int) -> tuple[nn.Module, list, set, ExpertSplit]:
    """A copy of the meta ``model`` with each layer's experts holding a rank's ``E / ep``, its units
    (each layer's experts their own, just before the unit that holds them; the per-expert units of
    ``expert_units`` dropped), the ids of the experts' units, and the split. Raises ValueError where
    ``ep`` cannot split the model's experts over ``dp_shard`` ranks."""
    cfg = _config(model)
    dim = int(getattr(cfg, "dim", None) or cfg.hidden_size)
    found = experts_of(model)
    num_experts, ffn = _shape(found[0], dim) if found else (0, 0)
    if problem := ep_problem(ep, dp_shard, num_experts):
        raise ValueError(problem)
    memo: dict = {}
    model = copy.deepcopy(model, memo)
    units = [memo[id(u)] for u in units]
    found = [memo[id(e)] for e in found]
    inside = {id(m) for e in found for m in e.modules()}
    units = [u for u in units if id(u) not in inside]
    for experts in found:
        _keep_local(experts, ep)
        holder = next(i for i, u in enumerate(units) if any(m is experts for m in u.modules()))
        units.insert(holder, experts)
    top_k = int(getattr(cfg, "num_experts_per_tok", None) or cfg.top_k)
    return model, units, {id(e) for e in found}, ExpertSplit(ep, num_experts, top_k, dim, ffn, len(found), blocks)


def expert_levels(placements: Placements, mesh_shape: dict, ep: int) -> Levels:
    """The experts' sharding levels: ``placements`` over ``([dp_replicate,] ep_shard)``, the shard axis
    ``ep`` times smaller."""
    shard = next(size for axis, size in mesh_shape.items() if axis != DP_REPLICATE)
    shape = {**{a: s for a, s in mesh_shape.items() if a == DP_REPLICATE}, EP_SHARD: shard // ep}
    return Levels.of(expert_placements(placements), shape)


def experts_notes(split: ExpertSplit, dp_shard: int, expert_bytes: int, dense_bytes: int,
                  shared: Optional[str] = None) -> list[str]:
    """The plan's lines on expert parallelism: how the experts are split, their share of this rank's
    model state, and the routing assumed."""
    return [describe_split(split.num_experts, split.ep, dp_shard // split.ep, shared),
            f"expert parallelism: model state on this rank (main weights, gradients, optimizer states) "
            f"{_size(expert_bytes)} for the experts ({split.num_experts // split.ep} of each layer's "
            f"{split.num_experts}, sharded {dp_shard // split.ep} ways), {_size(dense_bytes)} for the rest "
            f"(sharded {dp_shard} ways)",
            f"expert parallelism: dispatch buffers per MoE layer of {split.layers}: the rows sent and received, there "
            "and back, in forward and backward, and the experts' saved activations over the received rows; "
            + IMBALANCE]


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"

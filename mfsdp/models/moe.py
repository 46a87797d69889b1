"""A mixture-of-experts variant of ``mfsdp.models.llama``, free of any parallelism.

``MoELlama`` is ``Llama`` with ``MoEFeedForward`` in place of each block's SwiGLU layer; the
attention, norms, rotary tables, activation checkpointing and initialisation are Llama's own.

Routing is top-k token choice, as in Mixtral: a bias-free linear router scores every expert
for every token, each token goes to its ``top_k`` best experts, and their outputs are mixed
with weights ``softmax`` over those ``top_k`` scores (the full softmax renormalised over the
chosen experts, so a token's weights sum to one).

Each expert is its own SwiGLU module in ``MoEFeedForward.experts`` (an ``nn.ModuleList``),
and the forward loops over them the way many user MoE codes do: gather the tokens routed to
the expert, run it, scatter-add the weighted outputs back. An expert that no token reached
is skipped entirely: its forward does not run and its parameters get no gradient from this
step. That is conditional computation: under data parallelism, different ranks can skip
different experts in the same step, and a sharding wrapper must cope with that.

Load balancing: each forward of an MoE layer leaves the Switch Transformer auxiliary loss
``num_experts * sum_i f_i * P_i`` in ``last_aux_loss`` (``f_i``: the fraction of this batch's
token-to-expert assignments that went to expert i, ``P_i``: the mean router probability of
expert i). It is 1 for a perfectly balanced router and grows as routing collapses onto few
experts. ``MoELlama.aux_loss()`` averages it over the layers; a training loop adds
``cfg.moe_aux_loss_coef * model.aux_loss()`` to its loss (``mfsdp train`` does).
"""

from __future__ import annotations

import torch
from torch import nn

from mfsdp.models.llama import FeedForward, Llama, LlamaConfig


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts: the drop-in replacement for ``FeedForward`` in a block."""

    def __init__(self, cfg: LlamaConfig, dtype=None, device=None):
        super().__init__()
        if cfg.num_experts < 1:
            raise ValueError("MoEFeedForward needs num_experts >= 1; use FeedForward for a dense "
                             "layer")
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False, dtype=dtype, device=device)
        self.experts = nn.ModuleList(FeedForward(cfg, dtype=dtype, device=device)
                                     for _ in range(cfg.num_experts))
        # The load-balancing loss of the latest forward (a scalar with autograd history).
        self.last_aux_loss: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routing of tokens ``x`` of shape (tokens, dim).

        Returns ``weights`` (tokens, top_k) in fp32, each row summing to one; ``experts``
        (tokens, top_k), the chosen expert ids, best first; and ``probs`` (tokens, num_experts),
        the full fp32 softmax of the router scores (for the load-balancing loss).
        """
        probs = self.router(x).float().softmax(dim=-1)
        top, experts = probs.topk(self.top_k, dim=-1)
        return top / top.sum(dim=-1, keepdim=True), experts, probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts, probs = self.route(x)
        # Sort the (token, slot) assignments by expert once: one host read of the counts per
        # layer instead of one per expert.
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        sizes = counts.tolist()
        token_of = order // self.top_k
        weight_of = weights.flatten()[order].to(x.dtype)
        out = torch.zeros_like(x)
        for expert, idx, w in zip(self.experts, token_of.split(sizes), weight_of.split(sizes)):
            if idx.numel() == 0:  # no token chose this expert: skip it entirely
                continue
            out.index_add_(0, idx, expert(x[idx]) * w[:, None])
        fraction = counts.float() / flat.numel()
        self.last_aux_loss = self.num_experts * (fraction * probs.mean(dim=0)).sum()
        return out.reshape(shape)

    def init_matrices(self) -> tuple[list[nn.Linear], list[nn.Linear]]:
        """For ``Llama.init_weights``: the router and the experts' input projections at init_std,
        the experts' output projections at the residual std."""
        return ([self.router, *(w for e in self.experts for w in (e.w1, e.w3))],
                [e.w2 for e in self.experts])


class MoELlama(Llama):
    """``Llama`` whose blocks route each token through ``top_k`` of ``num_experts`` experts.

    With ``num_experts=0`` it is the dense ``Llama`` exactly (same modules, same init draws).
    """

    def make_feed_forward(self, cfg: LlamaConfig, dtype=None, device=None) -> nn.Module:
        if cfg.num_experts == 0:
            return super().make_feed_forward(cfg, dtype=dtype, device=device)
        return MoEFeedForward(cfg, dtype=dtype, device=device)

    def moe_layers(self) -> list[MoEFeedForward]:
        """The MoE feed-forward layers, bottom to top (empty for a dense config)."""
        return [b.feed_forward for b in self.layers if isinstance(b.feed_forward, MoEFeedForward)]

    def aux_loss(self) -> torch.Tensor:
        """The load-balancing loss of the latest forward, averaged over the MoE layers.

        Read it after the forward and before the backward (with activation checkpointing, the
        recomputation in backward replaces the stored values). Zero for a dense config.
        """
        losses = [layer.last_aux_loss for layer in self.moe_layers()]
        if any(loss is None for loss in losses):
            raise RuntimeError("aux_loss() is only defined after a forward pass")
        if not losses:
            return self.rope_cos.new_zeros(())
        return torch.stack(losses).mean()

    def set_activation_checkpointing(self, enabled: bool, reentrant: bool = False) -> None:
        if enabled and reentrant and self.moe_layers():
            # The reentrant implementation runs the forward without autograd, so the stored
            # load-balancing losses would carry no gradient to the routers.
            raise ValueError("MoE blocks need non-reentrant activation checkpointing (the "
                             "load-balancing loss is taken from inside the block); pass "
                             "reentrant=False")
        super().set_activation_checkpointing(enabled, reentrant)


def build_model(cfg: LlamaConfig, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> Llama:
    """``MoELlama`` when ``cfg.num_experts`` is positive, else the dense ``Llama``."""
    cls = MoELlama if cfg.num_experts else Llama
    return cls(cfg, dtype=dtype, device=device)


__all__ = ["MoEFeedForward", "MoELlama", "build_model"]

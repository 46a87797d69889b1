"""A mixture-of-experts variant of ``mfsdp.models.llama``, free of any parallelism.

``MoELlama`` is ``Llama`` with ``MoEFeedForward`` in place of each block's SwiGLU layer; the
attention, norms, rotary tables, activation checkpointing and initialisation are Llama's own.

Routing is top-k token choice, as in Mixtral: a bias-free linear router scores every expert
for every token, each token goes to its ``top_k`` best experts, and their outputs are mixed
with weights ``softmax`` over those ``top_k`` scores (the full softmax renormalised over the
chosen experts, so a token's weights sum to one).

The experts are stacked, as transformers 5 stores Mixtral's and Qwen3-MoE's: one
``GroupedExperts`` module per layer holds every expert's SwiGLU in two parameters,
``gate_up_proj`` ``[E, 2F, D]`` (each expert's gate rows, then its up rows) and ``down_proj``
``[E, D, F]``, with the interface of ``mfsdp.experts``, so one expert-parallel implementation
serves these models and Hugging Face's. Its forward sorts the (token, slot) assignments by expert
(``mfsdp.experts.dispatch``), runs each expert over its rows (``mfsdp.experts.grouped``) and mixes
the outputs back with the router weights. The experts module runs on every rank in every step
whatever the routing: an expert that no token reached computes nothing and gets a zero slice
of the stacked gradient.

Load balancing: each forward of an MoE layer leaves the Switch Transformer auxiliary loss
``num_experts * sum_i f_i * P_i`` in ``last_aux_loss`` (``f_i``: the fraction of this batch's
token-to-expert assignments that went to expert i, ``P_i``: the mean router probability of
expert i). It is 1 for a perfectly balanced router and grows as routing collapses onto few
experts. ``MoELlama.aux_loss()`` averages it over the layers; a training loop adds
``cfg.moe_aux_loss_coef * model.aux_loss()`` to its loss (``mfsdp train`` does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mfsdp.experts.dispatch import combine, dispatch
from mfsdp.experts.grouped import expert_swiglu
from mfsdp.models.llama import Llama, LlamaConfig

EXPERTS_LAYOUT = "stacked"
"""How the bundled MoE stores its experts (``GroupedExperts``), recorded in each checkpoint's model
fingerprint: a checkpoint written with one module per expert cannot load into these parameters."""


class GroupedExperts(nn.Module):
    """A layer's ``num_experts`` SwiGLU experts, stacked: expert ``e`` computes
    ``down_proj[e] @ (silu(gate x) * up x)`` with ``gate_up_proj[e]`` = cat(gate, up) on rows (the
    dense layer's w1 then w3; ``down_proj[e]`` its w2)."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, dtype=None, device=None):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_dim, dim, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, ffn_dim, dtype=dtype, device=device))
        self.act_fn = F.silu

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden`` [T, D], each token's expert ids and weights [T, K] -> [T, D]."""
        rows, counts, state = dispatch(hidden, top_k_index, self.num_experts)
        out = expert_swiglu(rows, counts, self.gate_up_proj, self.down_proj, self.act_fn)
        return combine(out, top_k_weights, state)


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
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.ffn_dim, dtype=dtype, device=device)
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
        out = self.experts(x, experts, weights)
        fraction = torch.bincount(experts.flatten(), minlength=self.num_experts).float() / experts.numel()
        self.last_aux_loss = self.num_experts * (fraction * probs.mean(dim=0)).sum()
        return out.reshape(shape)

    def init_matrices(self) -> tuple[list, list]:
        """For ``Llama.init_weights``: the router and every expert's gate and up rows at init_std,
        every expert's down projection at the residual std (the stacked parameters themselves)."""
        return [self.router, self.experts.gate_up_proj], [self.experts.down_proj]

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


__all__ = ["EXPERTS_LAYOUT", "GroupedExperts", "MoEFeedForward", "MoELlama", "build_model"]

"""Models whose ranks run different modules, and their full-batch reference (conditional computation).

Every model takes ``(tokens, flag)``: ``flag`` decides, per rank and microbatch, whether the
conditional part runs (an expert, a block, an image encoder). The reference runs the very same
function on every rank's slices in turn, so sharded training must match it to fp32 rounding.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import mfsdp
from mfsdp.models.llama import FeedForward
from mfsdp.models.moe import MoEFeedForward
from models import Block, full_params, global_batch, loss_fn, make_mesh, make_placements, max_rel_error

VARIANTS = ["nested", "nested_equal", "skip_block", "expert_module", "vlm", "vlm_same", "passthrough"]


class ExpertBlock(nn.Module):
    """A block whose main sub-block is its own FSDP unit, plus an expert only some ranks call."""

    def __init__(self, dim: int, hidden: int, expert: str, checkpointing=None) -> None:
        super().__init__()
        self.inner = Block(dim, hidden, checkpointing)
        self.expert = nn.Linear(dim, dim) if expert == "linear" else Block(dim, hidden)
        self.use_expert = True

    def forward(self, h):
        h = self.inner(h)
        return h + self.expert(h) if self.use_expert else h


class PassThrough(nn.Module):
    """A parent that returns its child's output tensor unchanged (hook order follows the child)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.child = ExpertBlock(dim, hidden, "linear")

    def forward(self, h):
        return self.child(self.lin(h))


class CondNet(nn.Module):
    def __init__(self, variant: str, vocab=13, dim=6, hidden=10, checkpointing=None) -> None:
        super().__init__()
        self.variant = variant
        self.embed = nn.Embedding(vocab, dim)
        if variant.startswith("vlm"):
            enc_dim = dim if variant == "vlm_same" else 4
            enc_hidden = hidden if variant == "vlm_same" else 7
            self.vision_embed = nn.Embedding(vocab, enc_dim)
            self.encoder = nn.ModuleList(Block(enc_dim, enc_hidden) for _ in range(2))
            self.projector = nn.Linear(enc_dim, dim)
        middle = {
            "nested": lambda: ExpertBlock(dim, hidden, "linear", checkpointing),
            "nested_equal": lambda: ExpertBlock(dim, hidden, "block"),
            "expert_module": lambda: ExpertBlock(dim, hidden, "block"),
            "passthrough": lambda: PassThrough(dim, hidden),
        }.get(variant, lambda: Block(dim, hidden, checkpointing))
        self.blocks = nn.ModuleList([Block(dim, hidden), middle(), Block(dim, hidden)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, flag: bool):
        h = self.embed(tokens)
        images = self.variant.startswith("vlm") and flag
        if images:
            img = self.vision_embed(tokens[:, :2])
            for block in self.encoder:
                img = block(img)
            h = torch.cat([self.projector(img), h], dim=1)
        for i, block in enumerate(self.blocks):
            if self.variant == "skip_block" and i == 1 and flag:
                continue
            for m in block.modules():
                if isinstance(m, ExpertBlock):
                    m.use_expert = flag
            h = block(h)
        if images:
            h = h[:, 2:]
        return self.head(self.norm(h))


def shard_cond(model: CondNet, mesh, placements, comm=None) -> CondNet:
    """fully_shard bottom-up: sub-blocks, experts and encoder blocks, then blocks, then the root."""
    def shard(module):
        mfsdp.fully_shard(module, mesh, placements, communication_policy=comm)

    for block in model.blocks:
        for m in reversed(list(block.modules())):  # children before parents
            if isinstance(m, ExpertBlock):
                shard(m.inner)
                if model.variant == "expert_module":
                    shard(m.expert)
                if m is not block:
                    shard(m)
        shard(block)
    for block in getattr(model, "encoder", []):
        shard(block)
    shard(model)
    return model


PATTERNS = {
    "even_ranks": lambda step, rank, m: rank % 2 == 0,  # the conditional part runs on even ranks only
    "sometimes": lambda step, rank, m: rank == 0 and (step + m) % 2 == 0,  # one rank, some steps/microbatches
}


def cond_parity(rank, ws, variants, kind, mb, pattern, comm=None, steps=3, checkpointing=None, device="cpu",
                delay=False):
    """Train each variant sharded and unsharded side by side; returns {variant: (max rel error, loss error)}.
    ``delay`` stalls every collective's stream first (CUDA), so a missing wait shows as wrong numbers."""
    from test_core_parity import _injected_delays

    with _injected_delays(delay):
        return _cond_parity(rank, ws, variants, kind, mb, pattern, comm, steps, checkpointing, device)


def _cond_parity(rank, ws, variants, kind, mb, pattern, comm, steps, checkpointing, device):
    out = {}
    for variant in variants:
        torch.manual_seed(0)
        model = CondNet(variant, checkpointing=checkpointing).to(device)
        ref = copy.deepcopy(model)
        shard_cond(model, make_mesh(kind, ws, device), make_placements(kind),
                   mfsdp.CommunicationPolicy(**comm) if comm else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        uses = PATTERNS[pattern]
        worst, loss_err = 0.0, 0.0
        for step in range(steps):
            x, y = global_batch(step, 2 * ws * mb, 5, 13, device)
            ref_loss = 0.0
            for r in range(ws):
                for m, (mx, my) in enumerate(zip(x.chunk(ws)[r].chunk(mb), y.chunk(ws)[r].chunk(mb))):
                    loss = loss_fn(ref(mx, uses(step, r, m)), my) / (ws * mb)
                    loss.backward()
                    ref_loss += loss.item()
            ref_opt.step()
            ref_opt.zero_grad()
            total = 0.0
            for m, (mx, my) in enumerate(zip(x.chunk(ws)[rank].chunk(mb), y.chunk(ws)[rank].chunk(mb))):
                with mfsdp.microbatch(model, is_last=m == mb - 1):
                    loss = loss_fn(model(mx, uses(step, rank, m)), my) / mb
                    loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            t = torch.tensor([total / ws], device=device)
            torch.distributed.all_reduce(t)
            loss_err = max(loss_err, abs(float(t) - ref_loss) / abs(ref_loss))
            worst = max(worst, max_rel_error(full_params(model), full_params(ref)))
        out[variant] = (worst, loss_err)
    return out


# ------------------------------------------------------------- a mixture of experts, one module per expert
class PerExpertExperts(nn.ModuleList):
    """The bundled MoE's experts one SwiGLU module per expert (``mfsdp.models.moe`` before its stacked
    ``GroupedExperts``; ``layers.N.feed_forward.experts.E.w1.weight``), with the same interface: an
    expert that no token chose is skipped, forward and backward, so ranks that route differently run
    different modules, and sharded alone (``per_expert_units``) such an expert is a unit that runs on
    some ranks only. ``from_stacked`` copies a ``GroupedExperts``' values, so both compute the same."""

    def __init__(self, cfg, dtype=None, device=None) -> None:
        super().__init__(FeedForward(cfg, dtype=dtype, device=device) for _ in range(cfg.num_experts))

    @classmethod
    @torch.no_grad()
    def from_stacked(cls, cfg, stacked) -> "PerExpertExperts":
        out = cls(cfg, dtype=stacked.gate_up_proj.dtype, device=stacked.gate_up_proj.device)
        for e, expert in enumerate(out):
            w1, w3 = stacked.gate_up_proj[e].chunk(2)
            for linear, value in ((expert.w1, w1), (expert.w3, w3), (expert.w2, stacked.down_proj[e])):
                linear.weight.copy_(value)
        return out

    def forward(self, hidden, top_k_index, top_k_weights):
        flat = top_k_index.flatten()
        order = flat.argsort(stable=True)
        sizes = torch.bincount(flat, minlength=len(self)).tolist()
        token_of, weight_of = order // top_k_index.shape[1], top_k_weights.flatten()[order].to(hidden.dtype)
        out = torch.zeros_like(hidden)
        for expert, idx, w in zip(self, token_of.split(sizes), weight_of.split(sizes)):
            if idx.numel():  # no token chose this expert: skip it entirely
                out.index_add_(0, idx, expert(hidden[idx]) * w[:, None])
        return out


class PerExpertFeedForward(MoEFeedForward):
    """``MoEFeedForward`` over ``PerExpertExperts``, initialised as the per-expert model was."""

    def init_matrices(self):
        return [self.router, *(w for e in self.experts for w in (e.w1, e.w3))], [e.w2 for e in self.experts]


def with_per_expert_modules(model):
    """``model`` (a ``MoELlama``, built on any device) with each layer's stacked experts replaced by
    ``PerExpertExperts`` of the same values."""
    for layer in model.moe_layers():
        layer.__class__ = PerExpertFeedForward
        layer.experts = PerExpertExperts.from_stacked(model.cfg, layer.experts)
    return model


def per_expert_units(model, mesh, placements, **kwargs) -> None:
    """Each expert of a ``with_per_expert_modules`` model sharded as a unit of its own (before its
    block's unit, which ``parallelize`` adds)."""
    for layer in model.moe_layers():
        for expert in layer.experts:
            mfsdp.fully_shard(expert, mesh, placements, **kwargs)

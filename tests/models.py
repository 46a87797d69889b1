"""Small models and reference training for the parity tests (shared by several test modules)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import mfsdp


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, checkpointing: str | None = None) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)
        self.checkpointing = checkpointing

    def _body(self, x):
        return self.w2(torch.tanh(self.w1(x)))

    def forward(self, x):
        if self.checkpointing is None:
            return x + self._body(x)
        return x + checkpoint(self._body, x, use_reentrant=self.checkpointing == "reentrant")


class Net(nn.Module):
    """Embedding, blocks, head. Row counts 13, 10 and 6 divide neither 2 nor 4 evenly."""

    def __init__(self, vocab=13, dim=6, hidden=10, n_blocks=3, tied=False, checkpointing=None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden, checkpointing) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_mesh(kind: str, world_size: int, device_type: str = "cpu"):
    if kind in ("hsdp", "hsdp_deferred", "hfsdp", "zero3_2d"):
        return init_device_mesh(device_type, (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))


def make_placements(kind: str) -> mfsdp.Placements:
    return {
        "zero3": lambda: mfsdp.Placements.zero3("dp"),
        "zero2": lambda: mfsdp.Placements.zero2("dp"),
        "zero1": lambda: mfsdp.Placements.zero1("dp"),
        "ddp": lambda: mfsdp.Placements.ddp("dp"),
        "hsdp": lambda: mfsdp.Placements.hsdp("replicate", "shard"),
        "hsdp_deferred": lambda: mfsdp.Placements.hsdp("replicate", "shard", defer_replicate_reduction=True),
        "hfsdp": lambda: mfsdp.Placements.hfsdp("replicate", "shard"),
        "zero3_2d": lambda: mfsdp.Placements.fully_sharded("replicate", "shard"),
    }[kind]()


def shard_net(model: Net, mesh, placements, policy=None, comm=None, **kwargs) -> Net:
    """fully_shard every block, then the root; ``kwargs`` go to each fully_shard call."""
    for unit in list(model.blocks) + [model]:
        mfsdp.fully_shard(unit, mesh, placements, mixed_precision_policy=policy, communication_policy=comm,
                          **kwargs)
    return model


def round_to_bf16(model: nn.Module) -> nn.Module:
    """Round every parameter to its nearest bf16 value, keeping its dtype."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def make_optimizer(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    raise ValueError(kind)


def global_batch(step: int, batch: int, seq: int, vocab: int, device="cpu"):  # noqa: D103
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
    return out


def max_rel_error(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for k in a:
        denom = b[k].abs().max().clamp_min(1e-6)
        worst = max(worst, float((a[k] - b[k]).abs().max() / denom))
    return worst


def reference_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def step_both(model, ref, optim, ref_optim, step: int, batch: int, rank: int, ws: int,
              after_backward=None, after_step=None) -> None:
    """One optimizer step of the reference on the global batch and of the sharded model on its slice
    (slice ``rank`` of ``ws``); the optional callbacks inspect the sharded model between phases."""
    x, y = global_batch(step, batch, 5, ref.embed.num_embeddings)
    loss_fn(ref(x), y).backward()
    ref_optim.step()
    ref_optim.zero_grad()
    loss_fn(model(x.chunk(ws)[rank]), y.chunk(ws)[rank]).backward()
    if after_backward is not None:
        after_backward()
    optim.step()
    if after_step is not None:
        after_step()
    optim.zero_grad()

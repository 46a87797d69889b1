"""Context parallel with the manager: mesh, sequence sharding and the dp x cp gradient reduction.

On CPU the model is position-wise (no attention), so a rank that sees only its part of the
sequence computes exactly its share of the gradient; torch's context_parallel has no CPU rule for
attention. The attention parity is the GPU test at the bottom (4 GPUs, else 2; skipped on CPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from models import full_params as full, max_rel_error
from test_manager_models import make_hf
from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh
from mfsdp.manager.context_parallel import shard_sequence, shift_labels


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class PositionWiseLM(nn.Module):
    """Token + position embedding, MLP blocks, head: every position is computed independently."""

    _no_split_modules = ["Block"]

    def __init__(self, vocab=32, dim=12, seq=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(2)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, position_ids, shift_labels=None, labels=None):
        h = self.tok(input_ids) + self.pos(position_ids)
        for b in self.blocks:
            h = b(h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index=-100,
                                           reduction="sum")


def cp_parity(rank, ws, cp=2, strategy=3, steps=3):
    torch.manual_seed(0)
    model = PositionWiseLM()
    ref = copy.deepcopy(model)
    mesh = build_device_mesh("cpu", cp_size=cp)
    manager = MegatronFSDPManager(MegatronFSDPConfig(zero_dp_strategy=strategy, cp_size=cp), mesh)
    model, _ = manager.parallelize(model)
    p = next(model.parameters())
    info = dict(axes=manager.placements.dp_axes, param_mesh=p.device_mesh.mesh_dim_names,
                param_mesh_size=p.device_mesh.size())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dp = ws // cp
    errors = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 32, (4, 16), generator=g)
        tokens = int((shift_labels(ids) != -100).sum())
        # Reference: the whole batch; the loss is a mean over all predicted tokens.
        ref_opt.zero_grad()
        pos = torch.arange(16).expand(4, 16)
        (ref(ids, pos, shift_labels(ids)) / tokens).backward()
        ref_opt.step()
        # Sharded: rows over dp, sequence over cp; each rank's loss is its token sum over the
        # tokens of its data-parallel batch, and the average over dp x cp ranks then needs a x cp.
        local = shard_sequence(mesh, {"input_ids": ids.chunk(dp)[mesh["dp_shard"].get_local_rank()],
                                      "labels": ids.chunk(dp)[mesh["dp_shard"].get_local_rank()]})
        loss = model(**local) * cp / (tokens / dp)
        loss.backward()
        opt.step()
        opt.zero_grad()
        errors.append(max_rel_error(full(model), full(ref)))
    dist.barrier()
    return info, errors


@pytest.mark.parametrize("strategy", [3, 1])
def test_cp_dp_parity_world4(world, strategy):
    info, errors = world(4).run(cp_parity, strategy=strategy)[0]
    assert info["axes"] == ("dp_shard_cp",) and info["param_mesh"] == ("dp_shard_cp",), info
    assert info["param_mesh_size"] == 4, info
    assert max(errors) < 5e-5, errors


def test_cp_only_world2(world):
    _, errors = world(2).run(cp_parity, strategy=3)[0]
    assert max(errors) < 5e-5, errors


def test_shard_sequence_single_process():
    class FakeMesh:  # shard_sequence only asks the cp dim for its rank and size
        def __init__(self, rank, size):
            self.rank, self.size_ = rank, size

        def __getitem__(self, name):
            assert name == "cp"
            return self

        def get_local_rank(self):
            return self.rank

        def size(self):
            return self.size_

    ids = torch.arange(12).view(2, 6)
    parts = [shard_sequence(FakeMesh(r, 3), {"input_ids": ids, "labels": ids}) for r in range(3)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), ids)
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], 1), torch.arange(6).expand(2, 6))
    labels = torch.cat([p["shift_labels"] for p in parts], 1)
    assert torch.equal(labels[:, :-1], ids[:, 1:]) and (labels[:, -1] == -100).all()
    assert torch.equal(parts[1]["labels"], parts[1]["shift_labels"])
    with pytest.raises(ValueError, match="does not divide"):
        shard_sequence(FakeMesh(0, 4), {"input_ids": ids})


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_causal_sdpa_matches_hf_sdpa(family):
    """What context parallel runs (causal SDPA, no mask tensor) equals HF's own SDPA path."""

    from mfsdp.manager import use_causal_sdpa

    model = make_hf(family, vocab=64, heads=4, kv_heads=2)  # grouped-query heads
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    ref_logits = model(input_ids=ids).logits
    ref_loss = model(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    use_causal_sdpa(model)
    assert model.config._attn_implementation == "mfsdp_causal_sdpa"
    torch.testing.assert_close(model(input_ids=ids).logits, ref_logits, rtol=1e-6, atol=1e-6)
    model(input_ids=ids, labels=ids).loss.backward()
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="no padding mask"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0))


def test_manager_switches_attention_for_cp(world):
    assert world(2).run(_cp_attention_name)[0] == "mfsdp_causal_sdpa"


def _cp_attention_name(rank, ws):

    model, _ = MegatronFSDPManager(MegatronFSDPConfig(cp_size=2), build_device_mesh("cpu", cp_size=2)).parallelize(
        make_hf("llama", vocab=64))
    return model.config._attn_implementation


# ------------------------------------------------------------------------------------- GPU
def cp_attention_parity(rank, ws):
    """HF Llama with SDPA under torch's context_parallel at dp x cp, vs the unsharded model."""

    from mfsdp.manager.context_parallel import attention_context

    model = make_hf("llama", vocab=64).cuda()
    model.set_attn_implementation("sdpa")
    ref = copy.deepcopy(model)  # HF's own SDPA path, unsharded
    cp = 2
    mesh = build_device_mesh("cuda", cp_size=cp)
    # Per-token loss: each rank sums its tokens' losses over the global token count and the
    # reduction sums, so unequal token counts per cp shard do not matter.
    model, _ = MegatronFSDPManager(MegatronFSDPConfig(calculate_per_token_loss=True), mesh).parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    dp = ws // cp
    errors = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        # 128 tokens: torch's ring attention over the memory-efficient kernel (fp32) needs each
        # load-balanced chunk to be a multiple of 32 tokens (its logsumexp is padded to 32).
        ids = torch.randint(0, 64, (2 * dp, 128), generator=g).cuda()
        ref_opt.zero_grad()
        ref(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step()
        mine = ids.chunk(dp)[mesh["dp_shard"].get_local_rank()]
        pos = torch.arange(mine.shape[1], device="cuda").expand_as(mine).contiguous()
        labels = shift_labels(mine)
        mine = mine.clone()
        total = ids.shape[0] * (ids.shape[1] - 1)
        with attention_context(mesh, [mine, pos, labels], [1, 1, 1]):
            logits = model(input_ids=mine, position_ids=pos).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                     reduction="sum") / total
            loss.backward()
        opt.step()
        opt.zero_grad()
        errors.append(max_rel_error(full(model), full(ref)))
    return errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cp_attention_parity_gpu():
    from _dist import World

    ws = 4 if torch.cuda.device_count() >= 4 else 2
    w = World(ws, backend="nccl")
    try:
        errors = w.run(cp_attention_parity)[0]
    finally:
        w.close()
    # fp32; ring attention sums in another order, hence a bound looser than the CPU tests'.
    assert max(errors) < 1e-3, errors

"""A module called again later in the same forward, identically on every rank (weight-shared layers:
ALBERT, Universal Transformers, looped models), trains with exact parity: its second call
re-gathers, and its backward takes its place in the backward walk. A reuse that differs between
ranks is a named error."""

from __future__ import annotations

import pytest
import torch

import mfsdp
from models import Net, global_batch, loss_fn, make_mesh, make_placements, reference_copy, shard_net
from test_core_parity import _check, _train_and_compare


class LoopedNet(Net):
    """The blocks run twice per forward, so each block is called again after all the others."""

    def __init__(self, again_on_rank0: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.again_on_rank0 = again_on_rank0

    def forward(self, tokens):
        h = self.embed(tokens)
        for _ in range(2):
            for block in self.blocks:
                h = block(h)
        if self.again_on_rank0 and torch.distributed.get_rank() == 0:
            h = self.blocks[0](h)  # a third call, on rank 0 only
        return self.head(self.norm(h))


def looped_parity(rank, ws, kind, mb, ckpt, nested=False):
    torch.manual_seed(0)
    model = LoopedNet(checkpointing=ckpt)
    ref = reference_copy(model)
    mesh, placements = make_mesh(kind, ws), make_placements(kind)
    if nested:  # each block's linears are units too: a reused block's visit holds theirs
        for block in model.blocks:
            mfsdp.fully_shard(block.w1, mesh, placements)
            mfsdp.fully_shard(block.w2, mesh, placements)
    shard_net(model, mesh, placements)
    return _train_and_compare(rank, ws, model, ref, "adamw", 3, mb, False, "cpu")


@pytest.mark.parametrize("ckpt", [None, "nonreentrant", "reentrant"])
@pytest.mark.parametrize("mb", [1, 2])
@pytest.mark.parametrize("kind", ["zero3", "zero2", "ddp"])
def test_blocks_called_twice_in_one_forward_train_like_the_reference(world, kind, mb, ckpt):
    _check(world(2).run(looped_parity, kind=kind, mb=mb, ckpt=ckpt))


@pytest.mark.parametrize("mb", [1, 2])
def test_reused_blocks_with_units_inside_train_like_the_reference(world, mb):
    _check(world(2).run(looped_parity, kind="zero3", mb=mb, ckpt=None, nested=True))


def reuse_on_one_rank(rank, ws):
    torch.manual_seed(0)
    model = LoopedNet(again_on_rank0=True)
    shard_net(model, make_mesh("zero3", ws), make_placements("zero3"),
              comm=mfsdp.CommunicationPolicy(check_collectives=True))
    x, y = global_batch(0, 2 * ws, 5, 13)
    try:
        loss_fn(model(x.chunk(ws)[rank]), y.chunk(ws)[rank]).backward()
    except mfsdp.CollectiveMismatchError as err:
        return str(err)
    return None


def test_a_reuse_that_differs_between_ranks_is_a_named_error(world):
    errors = world(2).run(reuse_on_one_rank, timeout=60)
    for e in errors:
        assert e is not None and "about to issue different collectives" in e, errors
        assert "rank 0: all_gather of 'blocks.0'" in e, e

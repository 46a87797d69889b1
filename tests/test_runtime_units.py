"""Runtime pieces tested without a model or a process group: gradient packing, pending reductions."""

from __future__ import annotations

import torch

import mfsdp
from mfsdp.runtime.in_flight import PendingReductions
from mfsdp.runtime.flat_buffer import FlatLayout, pack_gradients


def test_pack_gradients_views_when_it_can_and_copies_when_it_must():
    # 2 shards: (4, 3) is even (no padding), (5, 2) pads to 6 rows, (2,) pads to 2 (even).
    layout = FlatLayout([torch.Size((4, 3)), torch.Size((5, 2)), torch.Size((2,))], num_shards=2)
    even = torch.randn(4, 3)
    padded = torch.randn(5, 2)
    keep, regions = pack_gradients([even, padded, None], layout.members, torch.float32, "cpu")
    assert regions[0].data_ptr() == even.data_ptr()  # zero-copy
    assert torch.equal(regions[1][:10], padded.view(-1)) and torch.equal(regions[1][10:], torch.zeros(2))
    assert torch.equal(regions[2], torch.zeros(2))  # a missing gradient reduces as zeros
    # Kept alive: every gradient (the copy may run on another stream) and the staging buffer.
    assert [t.data_ptr() for t in keep] == [
        even.data_ptr(), padded.data_ptr(), regions[1].untyped_storage().data_ptr()]
    # Another dtype is always staged, cast in the copy.
    _, regions = pack_gradients([even.bfloat16(), padded, torch.ones(2)], layout.members, torch.float32, "cpu")
    assert regions[0].dtype == torch.float32 and torch.equal(regions[0], even.bfloat16().float().view(-1))
    # A non-contiguous gradient is staged too.
    _, regions = pack_gradients([torch.randn(3, 4).t(), padded, torch.ones(2)], layout.members, torch.float32, "cpu")
    assert regions[0].is_contiguous() and regions[0].numel() == 12


def test_small_reductions_do_not_wait_on_a_large_pending_one():
    pending = PendingReductions()
    pending.track(None, ["head"], nbytes=1000)  # the output head: large
    pending.release(None, incoming_bytes=10)  # the root's norms: tiny, do not wait
    assert len(pending) == 1
    pending.track(None, ["root"], nbytes=10)
    pending.release(None, incoming_bytes=1)  # two pending: the oldest goes, whatever its size
    assert [r.keep_alive for r in pending] == [["root"]]
    pending.release(None, incoming_bytes=300)  # a block: 4 x 300 >= what is pending, so wait
    assert not pending
    pending.track(None, ["block"], nbytes=300)
    pending.release(None, incoming_bytes=300)  # equal blocks: one pending at a time, as before
    assert not pending
    pending.track(None, ["a"], nbytes=1)
    pending.release(None)  # end of backward: everything
    assert not pending


def test_registered_gather_slots_fall_back_where_nothing_would_use_them():
    """use_symm_mem / nccl_ub: one-rank gather groups get plain persistent slots silently (nothing is
    sent); an NCCL without a mem allocator gets them with one warning naming the cause, not a crash;
    otherwise the slots are registered."""
    import warnings

    import pytest

    from mfsdp.runtime.gather_slots import registration

    problem = "NCCL mem allocator is not supported in this NCCL version"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails these two
        assert registration([1], None) is False
        assert registration([1, 1], problem) is False  # one GPU: no warning even without an allocator
        assert registration([2, 1], None) is True
    with pytest.warns(UserWarning, match="mem allocator is not supported.*persistent unregistered"):
        assert registration([2], problem) is False


def test_an_nccl_without_mem_allocator_is_a_reason_not_a_crash():
    """torch's NCCL backend raises RuntimeError from its ``mem_allocator`` property where NCCL has no
    ncclMemAlloc (seen on one H200, torch 2.11): the probe turns that into the reason
    ``registration`` warns with, where ``hasattr`` itself raised."""
    from mfsdp import _compat

    class NoAllocator:
        @property
        def mem_allocator(self):
            raise RuntimeError("NCCL mem allocator is not supported in this NCCL version\nmore detail")

    class WithAllocator:
        mem_allocator = object()

    assert _compat.nccl_mem_allocator(NoAllocator()) == (
        None, "NCCL mem allocator is not supported in this NCCL version")
    assert _compat.nccl_mem_allocator(WithAllocator()) == (WithAllocator.mem_allocator, None)


def test_only_the_parameter_group_writes_weight_staleness():
    """Staleness has one owner: every other file says ``weights_written()`` / ``refresh_if_stale()``."""
    import ast
    from pathlib import Path

    package = Path(mfsdp.__file__).parent
    writers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in (
                        "_stale", "_weights_epoch", "weights_epoch", "needs_refresh"):
                    writers.add(str(path.relative_to(package)))
    assert writers == {"runtime/parameter_group.py"}, writers

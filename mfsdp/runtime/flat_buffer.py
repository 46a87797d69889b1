"""Flat buffers: one contiguous tensor per parameter group and level of sharding.

Layout. A group has members (its parameters, plus the usage counters of its gradients). Member
``i`` of ``n_i`` rows of ``r_i`` elements is padded to ``P_i = c_i * K`` rows, where ``K`` is the
number of optimizer shards and ``c_i = ceil(n_i / K)``. At a level split ``D`` ways (``D`` divides
``K``), every rank holds ``P_i / D`` rows of every member, members back to back::

    level D, one rank:  | m0: P_0/D rows | m1: P_1/D rows | ... |
    level 1 (gathered): | m0: P_0 rows (n_0 real) | m1: P_1 rows (n_1 real) | ... |

A collective between two levels therefore moves every member between two contiguous regions: no
copy-in or copy-out, and the gathered rows of a member are the parameter itself, a plain view.
The shard of optimizer index ``k`` holds rows ``[k*c, (k+1)*c)`` clipped to ``n``: exactly
``torch.chunk``, so the DTensors built on it are well-formed, with empty shards where ``n < K``.

Trade-off taken: padding costs at most ``K - 1`` rows per member, and a padded member needs a copy
to feed the gradient reduction (its autograd gradient has only ``n`` rows). Shapes whose first dim
is a multiple of ``K`` (the usual case for LLM weights) take the zero-copy path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from mfsdp import _compat


@dataclasses.dataclass(frozen=True)
class MemberLayout:
    """One logical tensor's geometry inside a group's flat buffers."""

    shape: torch.Size
    rows: int
    row_numel: int
    chunk_rows: int
    """Rows per optimizer shard (``ceil(rows / K)``)."""
    num_shards: int
    """``K``, the number of optimizer shards."""

    @property
    def padded_rows(self) -> int:
        return self.chunk_rows * self.num_shards

    @property
    def is_padded(self) -> bool:
        return self.padded_rows != self.rows

    def rows_of_shard(self, index: int) -> int:
        """Real (unpadded) rows held by optimizer shard ``index``: ``torch.chunk`` semantics."""
        return max(0, min(self.chunk_rows, self.rows - index * self.chunk_rows))


class FlatLayout:
    """Offsets of every member at every level of sharding."""

    def __init__(self, shapes: Sequence[torch.Size], num_shards: int) -> None:
        members = []
        for shape in shapes:
            if len(shape) == 0:
                raise NotImplementedError("0-dim parameters cannot be sharded along dim 0; reshape them to (1,)")
            chunk = max(1, -(-shape[0] // num_shards))  # ceil(rows / K), at least one row
            members.append(MemberLayout(torch.Size(shape), shape[0], math.prod(shape[1:]), chunk, num_shards))
        self.members: tuple[MemberLayout, ...] = tuple(members)
        self.num_shards = num_shards

    def numel(self, ways: int) -> int:
        """Per-rank elements of the whole group at a level split ``ways`` ways."""
        return sum(self._member_numel(m, ways) for m in self.members)

    def _member_numel(self, member: MemberLayout, ways: int) -> int:
        assert self.num_shards % ways == 0, (ways, self.num_shards)
        return member.padded_rows // ways * member.row_numel

    def regions(self, flat: torch.Tensor, ways: int) -> list[torch.Tensor]:
        """1-D views of every member's region in ``flat``, a level split ``ways`` ways."""
        views, offset = [], 0
        for member in self.members:
            size = self._member_numel(member, ways)
            views.append(flat[offset : offset + size])
            offset += size
        return views

    def unpadded(self, regions: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The real rows of fully gathered regions, shaped like the members."""
        return [_first_rows(r, m, m.rows) for r, m in zip(regions, self.members)]

    def shards(self, regions: Sequence[torch.Tensor], index: int) -> list[torch.Tensor]:
        """The real rows of optimizer shard ``index`` in optimizer-level regions."""
        return [_first_rows(r, m, m.rows_of_shard(index)) for r, m in zip(regions, self.members)]


def _first_rows(region: torch.Tensor, member: MemberLayout, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of a member's 1-D ``region``, shaped like the member's rows."""
    return region[: rows * member.row_numel].view((rows,) + tuple(member.shape[1:]))


class ByteLayout:
    """A ``FlatLayout`` whose members have dtypes of their own, in one byte (uint8) buffer: the
    unsharded buffer of a group with a gather codec (float8 weights beside bf16 norms).

    Same member geometry as ``layout``; regions are views in each member's dtype, and every member's
    region starts at a multiple of ``ALIGN`` bytes, so each typed view is aligned for vectorised
    kernels and collectives. The gaps are never gathered: each member has its own collective in the
    group's one coalesced launch.
    """

    ALIGN = 16
    dtype = torch.uint8

    def __init__(self, layout: FlatLayout, dtypes: Sequence[torch.dtype]) -> None:
        assert len(dtypes) == len(layout.members), (len(dtypes), len(layout.members))
        self.layout = layout
        self.members = layout.members
        self.dtypes = tuple(dtypes)

    def _spans(self, ways: int) -> list[tuple[int, int, torch.dtype]]:
        """(byte offset, elements, dtype) of every member at a level split ``ways`` ways."""
        spans, offset = [], 0
        for member, dtype in zip(self.members, self.dtypes):
            numel = self.layout._member_numel(member, ways)
            spans.append((offset, numel, dtype))
            offset += -(-numel * dtype.itemsize // self.ALIGN) * self.ALIGN
        return spans

    def numel(self, ways: int) -> int:
        """Bytes of the whole group at a level split ``ways`` ways (alignment gaps included)."""
        offset, numel, dtype = self._spans(ways)[-1]
        return offset + numel * dtype.itemsize

    def regions(self, flat: torch.Tensor, ways: int) -> list[torch.Tensor]:
        """1-D views, each in its member's dtype, of every member's region in the bytes ``flat``."""
        return [flat[offset : offset + numel * dtype.itemsize].view(dtype)
                for offset, numel, dtype in self._spans(ways)]


class FlatBuffer:
    """A 1-D tensor whose storage can be released and re-allocated in place.

    Views taken once stay valid across release and re-allocation, because the storage object is
    the same; this is what lets autograd keep the unsharded weights it saved in forward.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.tensor = torch.zeros(numel, dtype=dtype, device=device)
        self._nbytes = numel * self.tensor.element_size()
        self.persistent = False

    @classmethod
    def over(cls, tensor: torch.Tensor) -> "FlatBuffer":
        """A persistent buffer over an existing 1-D tensor (a gather slot): never released."""
        buf = cls.__new__(cls)
        buf.tensor, buf._nbytes, buf.persistent = tensor, tensor.numel() * tensor.element_size(), True
        return buf

    @property
    def is_allocated(self) -> bool:
        return self.tensor.untyped_storage().size() == self._nbytes

    def allocate(self) -> None:
        """Give the storage its bytes back, on the current stream (contents undefined)."""
        if not self.persistent and not self.is_allocated:
            self.tensor.untyped_storage().resize_(self._nbytes)

    def release(self) -> None:
        """Return the bytes to the allocator; the stream that allocated them may reuse them."""
        if self._nbytes and not self.persistent and self.is_allocated:
            self.tensor.untyped_storage().resize_(0)


def pack_gradients(grads, members, dtype: torch.dtype, device) -> tuple[list, list]:
    """Each member's gradient as a padded 1-D region in ``dtype``, ready for the reduction.

    A gradient that is contiguous, unpadded and already in ``dtype`` is used as is (a view, no
    copy); the others are copied into one staging buffer in a single fused launch, and a missing
    gradient (None) becomes zeros. Call it on the reduction's stream, after that stream waited
    for the gradients' producer. Returns (tensors to keep alive until the reduction has read them,
    regions): every gradient, since the producer's stream must not reuse one before its copy ran,
    and the staging buffer.
    """
    regions: list = [None if gr is None or m.is_padded or gr.dtype != dtype or not gr.is_contiguous() else gr.view(-1)
                     for gr, m in zip(grads, members)]
    staged = [i for i, region in enumerate(regions) if region is None]  # filled from the staging buffer
    keep: list = [gr for gr in grads if gr is not None]
    if staged:
        sizes = [members[i].padded_rows * members[i].row_numel for i in staged]
        # Uninitialised: the copy fills the real rows; only padding and missing gradients are
        # zeroed, so no full memset of the staging buffer per backward.
        buf = torch.empty(sum(sizes), dtype=dtype, device=device)
        dst, src, zero = [], [], []
        for i, region in zip(staged, torch.split(buf, sizes)):
            regions[i] = region
            real = 0 if grads[i] is None else members[i].rows * members[i].row_numel
            if grads[i] is not None:
                dst.append(region[:real].view(grads[i].shape))
                src.append(grads[i])
            if real < region.numel():  # padding, or the whole region of a missing gradient
                zero.append(region[real:])
        if dst:
            _compat.foreach_copy_(dst, src)
        if zero:
            _compat.foreach_zero_(zero)
        keep.append(buf)
    return keep, regions

"""Mixture-of-experts weights on disk and in memory: the one rule between them, for loading and export.

transformers 5 keeps a layer's experts stacked (``mlp.experts.gate_up_proj`` ``[E, 2F, D]``,
``mlp.experts.down_proj`` ``[E, D, F]``), while ``save_pretrained`` writes, and every published
checkpoint stores, each expert under its own names (``mlp.experts.3.gate_proj.weight``), as
transformers' own ``conversion_mapping.py`` converts them: expert ``e``'s slab of a stacked tensor
is its projections' matrices one after another on rows. Mixtral's also live under
``block_sparse_moe`` on disk and ``mlp`` in memory. ``LAYOUTS`` holds each model type's names;
``on_disk`` maps a model tensor to the per-expert tensors it is made of, ``disk_name`` renames one
that is not split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence


@dataclass(frozen=True)
class ExpertLayout:
    stacked: dict[str, tuple[str, ...]]
    """A stacked tensor's name in ``experts`` -> the per-expert projections its slabs are made of, by rows."""
    renames: tuple[tuple[str, str], ...] = ()
    """(in memory, on disk) parts of a name."""


QWEN_MOE = ExpertLayout({"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)})
LAYOUTS = {"qwen2_moe": QWEN_MOE, "qwen3_moe": QWEN_MOE,
           "mixtral": ExpertLayout({"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)},
                                   ((".mlp.", ".block_sparse_moe."),))}


@dataclass(frozen=True)
class Piece:
    """One on-disk tensor: rows ``rows`` of expert ``expert``'s slab of a stacked tensor."""
    key: str
    expert: int
    rows: slice

    def shape(self, stacked: Sequence[int]) -> tuple[int, ...]:
        return (self.rows.stop - self.rows.start, *stacked[2:])

    def of(self, stacked):
        """This piece of the whole stacked tensor."""
        return stacked[self.expert, self.rows]


def layout_of(model_or_config) -> Optional[ExpertLayout]:
    """The expert layout of a model (or its config) by ``model_type``; None: not a known MoE."""
    config = getattr(model_or_config, "config", model_or_config)
    return LAYOUTS.get(getattr(config, "model_type", None))


def disk_name(name: str, layout: Optional[ExpertLayout]) -> str:
    """``name`` as the checkpoint spells it."""
    for memory, disk in layout.renames if layout else ():
        name = name.replace(memory, disk)
    return name


def on_disk(name: str, shape: Sequence[int], layout: Optional[ExpertLayout]) -> Optional[list[Piece]]:
    """The per-expert tensors stacked tensor ``name`` of ``shape`` is stored as, expert by expert and
    each expert's in row order; None for a tensor stored under its own (``disk_name``) name."""
    head, _, leaf = disk_name(name, layout).rpartition(".experts.")
    parts = layout.stacked.get(leaf) if layout and head else None
    if parts is None or len(shape) != 3 or shape[1] % len(parts):
        return None
    rows = shape[1] // len(parts)
    return [Piece(f"{head}.experts.{e}.{part}.weight", e, slice(i * rows, (i + 1) * rows))
            for e in range(shape[0]) for i, part in enumerate(parts)]


def by_expert(pieces: list[Piece]) -> list[list[str]]:
    """``on_disk``'s pieces as the names of each expert's, in row order."""
    out: list[list[str]] = [[] for _ in range(pieces[-1].expert + 1)]
    for piece in pieces:
        out[piece.expert].append(piece.key)
    return out


def exported_names(name: str, shape: Sequence[int], layout: Optional[ExpertLayout]) -> list[tuple[str, Optional[Piece]]]:
    """What an export writes for model tensor ``name``: (on-disk name, its piece of the tensor, or
    None for the whole tensor)."""
    pieces = on_disk(name, shape, layout)
    return [(piece.key, piece) for piece in pieces] if pieces else [(disk_name(name, layout), None)]


def piece_reader(sources: dict, load: Callable[[Hashable], object]) -> Callable:
    """``read(entry)`` for ``write_weights``: ``sources[entry.name]`` is ``(key, piece)``; a stacked
    tensor is loaded once (``load(key)``) for all its experts' pieces, in the order they are written,
    and dropped with the next one: one whole tensor held at a time."""
    last: dict = {}

    def read(entry):
        key, piece = sources[entry.name]
        if key not in last:
            last.clear()
            last[key] = load(key)
        return piece.of(last[key]) if piece else last.pop(key)

    return read

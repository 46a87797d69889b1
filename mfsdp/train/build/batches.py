"""What each step trains on: the sampler of the token file's kind, and a run's length in epochs.

A token stream (pretraining text) gives random windows (``WindowSampler``); a file of samples
(prompt/completion or chat rows) gives whole samples packed into windows (``PackedSampler``), and a
file of preference pairs its pairs (``PairWindows``: packed with a shared prompt on the bundled route,
one pair a window, padded, through the manager, which has no document attention). All
leave out the held-out tail (``evaluate.held_out_split``) and are pure functions of the step, so a
resume needs only the step counter.
"""

from __future__ import annotations

from mfsdp.data import PackedSampler, PairWindows, TokenFile, WindowSampler
from mfsdp.train.command.errors import require


def make_sampler(cfg, data: TokenFile, held: int, rank: int, world: int) -> WindowSampler | PackedSampler:
    """This rank's sampler over the training part of ``data`` (all but the ``held`` held out)."""
    d = cfg.data
    shares = dict(seed=d.seed, microbatches=d.microbatches)
    if data.num_samples is None:
        return WindowSampler(data, d.seq_len, d.local_batch, rank, world, limit=len(data) - held, **shares)
    samples = range(data.num_samples - held)
    windows = PairWindows(data, d.seq_len, samples, packed=not cfg.model.uses_manager) if data.is_pairs else None
    return PackedSampler(data, d.seq_len, d.local_batch, rank, world, samples=samples, packing=d.packing,
                         windows=windows, **shares)


def steps_for_epochs(cfg, data: TokenFile, held: int, world: int) -> int:
    """The steps of ``--train.epochs`` passes over the training samples at ``world`` ranks."""
    require(data.num_samples is not None, f"--train.epochs needs a file of samples, and {data.path} is a "
            "token stream (its windows are drawn at random); set --train.steps instead")
    return cfg.train.epochs * make_sampler(cfg, data, held, 0, world).steps_per_epoch

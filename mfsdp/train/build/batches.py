"""What each step trains on: the sampler of the token file's kind, and a run's length in epochs.

A token stream (pretraining text) gives random windows (``WindowSampler``); a file of samples
(prompt/completion or chat rows) gives whole samples packed into windows (``PackedSampler``), and a
file of preference pairs its pairs (``PairWindows``: packed with a shared prompt on the bundled route,
one pair a window, padded, through the manager, which has no document attention). All
leave out the held-out tail (``evaluate.held_out_split``) and are pure functions of the step, so a
resume needs only the step counter.
"""

from __future__ import annotations

from mfsdp.data import (EvalWindows, PackedEvalWindows, PackedSampler, PairEvalWindows, PairWindows, TokenFile,
                        WindowSampler)
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


def eval_windows(cfg, data: TokenFile, source: TokenFile, held: int, rank: int, world: int):
    """The validation windows of ``source`` (``--data.val_path``'s file, else the training file ``data``,
    whose last ``held`` tokens or samples are held out) of the token file's kind, as ``make_sampler``
    chooses training's: how many eval batches they take, and a note for the run's line. Pairs are each
    visited once, numbered after the training file's when they come from --data.val_path."""
    d = cfg.data
    shares = (d.seq_len, d.local_batch, rank, world, d.microbatches)
    first = 0 if d.val_path is not None else (source.num_samples or 0) - held
    if source.is_pairs:
        pairs = PairWindows(source, d.seq_len, range(first, source.num_samples), packed=not cfg.model.uses_manager,
                            first_id=data.num_samples if d.val_path is not None else 0)
        windows = PairEvalWindows(pairs, *shares[1:])
        return windows, windows.batches_needed, f" (every pair once: {len(pairs.members):,} pairs)"
    if source.num_samples is not None:
        windows = PackedEvalWindows(source, *shares, samples=range(first, source.num_samples), packing=d.packing)
    else:
        windows = EvalWindows(source, *shares, start=0 if d.val_path is not None else len(data) - held)
    return windows, cfg.train.eval_batches, ""


def steps_for_epochs(cfg, data: TokenFile, held: int, world: int) -> int:
    """The steps of ``--train.epochs`` passes over the training samples at ``world`` ranks."""
    require(data.num_samples is not None, f"--train.epochs needs a file of samples, and {data.path} is a "
            "token stream (its windows are drawn at random); set --train.steps instead")
    return cfg.train.epochs * make_sampler(cfg, data, held, 0, world).steps_per_epoch

"""Gradient-accumulation scope."""

from __future__ import annotations

import contextlib

from torch import nn

from mfsdp.runtime.module import FsdpModule, build_context, fsdp_roots


def _roots(module: nn.Module) -> list[FsdpModule]:
    roots = fsdp_roots(module)
    if not roots:
        raise ValueError(f"microbatch: no fully_shard-ed module under {type(module).__name__}")
    return roots


@contextlib.contextmanager
def microbatch(module: nn.Module, is_last: bool):
    """Scope one microbatch's forward *and* backward.

    Axes whose gradient placement is ``Partial`` are reduced only when ``is_last`` is true; with
    ``is_last=False`` their gradients accumulate locally. Outside any scope every backward counts as
    the last: always correct, with more communication. ``module`` is a root or contains roots.
    """
    contexts = [build_context(root) for root in _roots(module)]
    previous = [ctx.is_last_microbatch for ctx in contexts]
    for ctx in contexts:
        ctx.is_last_microbatch = bool(is_last)
    try:
        yield
    finally:
        for ctx, value in zip(contexts, previous):
            ctx.is_last_microbatch = value

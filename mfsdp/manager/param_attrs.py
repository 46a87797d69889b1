"""Snapshot and restore of plain per-parameter attributes across a post-wrap rebuild.

mfsdp itself keeps no load-bearing state on Parameter objects: ownership and grouping live in
identity-keyed weak maps inside the core, so these helpers are not needed for mfsdp to keep
working. They exist for drop-in compatibility and for *user* attributes (for example a
``param.is_embedding`` tag a recipe sets): code that rebuilds Parameters after wrapping can carry
such tags over by name.
"""

from __future__ import annotations

import copy
from typing import Optional

from torch import nn

from mfsdp import FsdpModule


def snapshot_distributed_param_attrs(model: nn.Module) -> Optional[dict[str, dict]]:
    """A copy of each parameter's ``__dict__``, keyed by every name it appears under.

    ``named_parameters(remove_duplicate=False)`` is used so a tied alias (``lm_head.weight``
    sharing ``model.embed_tokens.weight``) gets its own entry. Returns None when no module of
    ``model`` is sharded by mfsdp (there is nothing distributed to snapshot).
    """
    if not any(isinstance(m, FsdpModule) for m in model.modules()):
        return None
    return {name: copy.copy(dict(vars(p))) for name, p in model.named_parameters(remove_duplicate=False)}


def restore_distributed_param_attrs(model: nn.Module, snapshot: Optional[dict[str, dict]]) -> None:
    """Copy back, by name, the snapshot attributes a current parameter lacks.

    Attributes the parameter already has are left alone, so state re-derived by the rebuild is
    never overwritten. ``snapshot=None`` is a no-op.
    """
    if snapshot is None:
        return
    for name, param in model.named_parameters(remove_duplicate=False):
        saved = snapshot.get(name)
        if not saved:
            continue
        current = vars(param)
        for key, value in saved.items():
            if key not in current:
                setattr(param, key, value)

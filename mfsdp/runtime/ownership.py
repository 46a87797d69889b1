"""Ownership: which parameters an FSDP module takes, how they group, and where they may be used.

Free functions over the module tree; ``fsdp_cls`` is the FsdpModule class, passed in so this file
does not import the module that imports it.
"""

from __future__ import annotations

from torch import nn

from mfsdp.runtime.registry import OWNER_OF_PARAMETER

def collect_owned_parameters(root: nn.Module, fsdp_cls: type):
    """Parameters under ``root`` not owned by an FSDP descendant, with every place holding each.

    Returns ``({param: [(module, attr, fqn), ...]}, [FSDP children])`` in first-seen order.
    """
    owned: dict[nn.Parameter, list] = {}
    children: list = []
    seen: set[tuple[int, str]] = set()
    # Iterative pre-order walk: a recursive closure would be a reference cycle holding ``owned`` (and
    # with it every module) until the garbage collector runs.
    stack: list[tuple[nn.Module, str]] = [(root, "")]
    while stack:
        module, prefix = stack.pop()
        for attr, param in module._parameters.items():
            if param is None or (id(module), attr) in seen:
                continue
            seen.add((id(module), attr))
            if param not in owned and param in OWNER_OF_PARAMETER:
                raise ValueError(
                    f"parameter {prefix + attr!r} is already owned by another FSDP module: either a child was "
                    "sharded after its parent (apply fully_shard bottom-up: blocks first, root last), or "
                    "the parameter is shared across FSDP modules (shard their common ancestor only)"
                )
            owned.setdefault(param, []).append((module, attr, prefix + attr))
        below = []
        for name, child in module._modules.items():
            if child is None:
                continue
            if isinstance(child, fsdp_cls):
                if child not in children:
                    children.append(child)
                continue
            below.append((child, f"{prefix}{name}."))
        stack.extend(reversed(below))  # the first child is visited next
    return owned, children


def gathers_in_backward(unit: nn.Module, owned: dict) -> bool:
    """Whether ``unit``'s backward needs its gathered weights. A bare embedding does not: its own
    ``nn.Embedding`` forward over only its own weight, whose backward reads the token ids and the
    output gradient, never the table; its gradient still arrives and is reduced as usual. A
    recompute in backward (activation checkpointing) gathers on demand, like any forward."""
    bare_embedding = (getattr(type(unit), "forward", None) is nn.Embedding.forward
                      and "forward" not in vars(unit)  # no per-instance replacement (tp_local's)
                      and all(module is unit for places in owned.values() for module, _, _ in places))
    return not bare_embedding


def group_parameters(owned: dict) -> list[tuple[list[nn.Parameter], list[list[tuple[nn.Module, str]]]]]:
    """Group parameters by (dtype, requires_grad), keeping first-seen order."""
    groups: dict[tuple, tuple[list, list]] = {}
    for param, places in owned.items():
        params, aliases = groups.setdefault((param.dtype, param.requires_grad), ([], []))
        params.append(param)
        # The modules' parameter dicts, not the modules: a group holding its own module would be a
        # reference cycle, freed only by the garbage collector.
        aliases.append([(module._parameters, attr) for module, attr, _ in places])
    return list(groups.values())


def unit_groups(unit: nn.Module, fsdp_cls: type, policy) -> tuple[dict, list, list]:
    """The one rule that turns a unit into parameter groups, for ``fully_shard`` and the memory
    planner alike: the parameters under ``unit`` no ``fsdp_cls`` descendant owns, those descendants,
    and one ``(params, aliases, dtypes)`` per (dtype, requires_grad) group, its dtypes resolved by
    ``policy`` (a ``MixedPrecisionPolicy``)."""
    owned, children = collect_owned_parameters(unit, fsdp_cls)
    groups = [(params, aliases, policy.resolve(params[0].dtype, trainable=params[0].requires_grad))
              for params, aliases in group_parameters(owned)]
    return owned, children, groups


def check_parameter_locations(root: nn.Module, fsdp_cls: type) -> None:
    """A parameter may be used only inside the FSDP module that owns it (first-forward check)."""

    def visit(module: nn.Module, owner, prefix: str) -> None:
        if isinstance(module, fsdp_cls):
            owner = module
        for attr, param in module._parameters.items():
            if param is None:
                continue
            holder = OWNER_OF_PARAMETER.get(param)
            if holder is not None and holder is not owner:
                raise ValueError(
                    f"parameter {prefix + attr!r} is shared with FSDP module {holder.name!r}, which "
                    "owns it; shard the modules sharing it together (fully_shard their common "
                    "ancestor, not each of them)"
                )
        for name, child in module._modules.items():
            if child is not None:
                visit(child, owner, f"{prefix}{name}.")

    visit(root, None, "")


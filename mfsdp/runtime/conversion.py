"""``nn.Module``'s conversions and state-dict loads on a sharded module: mfsdp's parameters keep
their shards.

The shards live in flat buffers that ``fully_shard`` allocated on the mesh's device (from the meta
device too), and every exposed DTensor is a view of them. ``nn.Module._apply`` would swap each
parameter for a new tensor (``torch.utils.swap_tensors``, always for DTensors), cutting it off from
the buffers that the gathers, reductions and optimizer steps use, so the parameters are kept out of
its reach. That makes the FSDP2 recipe work: build on meta, ``fully_shard``,
``to_empty(device=...)`` (materialises the buffers and keeps the already allocated shards), then
the model's ``init_weights()``, which writes through the DTensors into the shards. A conversion that
would change the shards' device or dtype raises instead. The compute weights are re-derived at the
next unshard, after whatever the caller writes into the shards next.

Free functions over a module and its groups, called from ``FsdpModule._apply`` and the load hook.
"""

from __future__ import annotations

import torch


def apply_keeping_shards(module, fn, recurse: bool, groups, apply):
    """Run ``apply(fn, recurse)`` (``nn.Module._apply`` of ``module``) with ``groups``' parameters
    taken out of every dict that holds them, then put back in each dict's order (so that
    ``named_parameters()`` is unchanged); the groups' weights count as written."""
    _check_conversion(module, fn, groups)
    saved: dict[int, tuple[dict, list]] = {}
    for group in groups:
        for sharded, unsharded, aliases in zip(group.sharded_params, group.params, group.aliases):
            for parameters, name in aliases:
                if parameters.get(name) is sharded or parameters.get(name) is unsharded:
                    saved.setdefault(id(parameters), (parameters, list(parameters.items())))
                    del parameters[name]
    try:
        return apply(fn, recurse)
    finally:
        for parameters, items in saved.values():
            current = dict(parameters)
            parameters.clear()
            parameters.update((key, current.get(key, value)) for key, value in items)
            parameters.update((key, value) for key, value in current.items() if key not in parameters)
        for group in groups:
            group.weights_written()  # the caller initialises or loads the shards next


def _check_conversion(module, fn, groups) -> None:
    """Raise where ``fn`` (an ``_apply`` conversion) would move or cast mfsdp's shards."""
    seen = set()
    for group in groups:
        shard = group.main.tensor
        if (shard.dtype, shard.device) in seen:
            continue
        seen.add((shard.dtype, shard.device))
        with torch.no_grad():
            probe = fn(torch.empty(0, dtype=shard.dtype, device=shard.device))
        if probe.device != shard.device or probe.dtype != shard.dtype:
            raise RuntimeError(
                f"mfsdp: {type(module).__name__} is sharded and its {group.label} shards live on "
                f"{shard.device} in {shard.dtype}; this conversion (to_empty/to/cuda/half/...) would "
                f"make them {probe.dtype} on {probe.device}, which mfsdp cannot do in place. The shards "
                f"stay on the mesh's device: build the model on the meta device (or on that device) "
                f"before fully_shard and call to_empty(device={str(shard.device)!r}); set dtypes "
                f"through MixedPrecisionPolicy (main_params_dtype) and the model's dtype, not .to()")


def after_load_state_dict(module) -> None:
    """A load copied values into the shards (refused if it replaced one: ``assign=True``); the
    compute weights are re-derived at the next unshard."""
    for group in module.parameter_groups:
        for sharded, aliases in zip(group.sharded_params, group.aliases):
            for parameters, name in aliases:
                if parameters.get(name) is not sharded:
                    raise RuntimeError(
                        f"load_state_dict replaced mfsdp's sharded parameter {name!r} of {module.name}"
                        " (assign=True?); load with assign=False so values are copied into the shards")
        group.weights_written()

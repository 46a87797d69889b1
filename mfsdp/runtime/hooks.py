"""The hooks ``fully_shard`` registers on an FsdpModule, and the marks each forward leaves on the
module's inputs and outputs. Each only signals the module (``pre_forward``, ``post_forward``,
``pre_backward``, ``_on_inputs_backward``); what a signal does is the module's and the walk's
business.

Free functions, registered once per ``fully_shard`` call (the forward marks once per forward). Every
hook holds its module by a weak reference: a parameter or an autograd node holding the module would
be a cycle that keeps every buffer of the model alive until the garbage collector runs.
"""

from __future__ import annotations

import weakref

import torch

from mfsdp import _compat
from mfsdp.runtime.conversion import after_load_state_dict
from mfsdp.runtime.errors import ORDER_HELP


class _InputsBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs right after the module's own backward."""

    @staticmethod
    def forward(ctx, module_ref, *tensors):
        ctx.module_ref = module_ref
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        module = ctx.module_ref()
        if module is not None:
            module._on_inputs_backward()
        return (None,) + grads


@torch.compiler.disable
def pre_hook(module, args, kwargs):
    """The forward pre-hook, outside compiled graphs (the entry frame the collective check names)."""
    return module.pre_forward(args, kwargs)


@torch.compiler.disable
def post_hook(module, args, output):
    """The forward hook, outside compiled graphs."""
    return module.post_forward(output)


def register_hooks(module) -> None:
    """The forward hooks, the state-dict load check and, per trainable parameter, the hook that names
    a gradient arriving after its module's reduction."""
    module.register_forward_pre_hook(pre_hook, prepend=True, with_kwargs=True)
    module.register_forward_hook(post_hook)
    module.register_load_state_dict_post_hook(lambda m, incompatible_keys: after_load_state_dict(m))
    ref = weakref.ref(module)
    for group in module.parameter_groups:
        if group.requires_grad:
            for param in group.params:
                param.register_post_accumulate_grad_hook(_late_gradient_hook(ref, group.geometry.grad_level))


def _late_gradient_hook(ref, grad_level: int):
    # Holds no strong reference to the group either (a parameter holding its group: the same cycle).
    @torch.compiler.disable
    def hook(param) -> None:
        module = ref()
        if module is None or module._context is None:
            return
        ctx = module._context
        if not ctx.has_reduced(module):
            return
        if grad_level > 0 or ctx.is_last_microbatch:  # the reduction read .grad
            raise RuntimeError(
                f"mfsdp: a gradient of {module.name or 'the root'} arrived after its reduction in this "
                f"backward; it would be lost. {ORDER_HELP}")

    return hook


def hook_inputs(module, args, kwargs):
    """``(args, kwargs)`` with the tensors that need grad passed through ``_InputsBackward``, whose
    backward tells ``module`` that its inputs' backward ran (its EXIT signal)."""
    flat, spec = _compat.tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return args, kwargs
    outs = _InputsBackward.apply(weakref.ref(module), *[flat[i] for i in positions])
    outs = outs if isinstance(outs, tuple) else (outs,)
    for i, t in zip(positions, outs):
        flat[i] = t
    return _compat.tree_unflatten(flat, spec)


def hook_outputs(module, output) -> None:
    """A hook on each output that needs grad: its gradient is ``module``'s ENTER signal."""
    ref = weakref.ref(module)

    @torch.compiler.disable
    def hook(grad):
        target = ref()
        if target is not None:
            target.pre_backward()
        return grad

    flat, _ = _compat.tree_flatten(output)
    for t in flat:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(hook)

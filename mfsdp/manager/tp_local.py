"""Tensor parallel on local tensors, Megatron's way: explicit collectives instead of DTensor dispatch.

The DTensor path (:func:`~mfsdp.manager.tp_plans.apply_tp_plan`) makes every activation inside a
tensor-parallel block a DTensor, so each op of attention and the MLP (views, rotary, softmax,
residual adds) goes through DTensor's sharding propagation on the host. On a 1B Llama at tp=2 the
host then needs as long to issue a step as the GPUs need to run it. This path keeps the same
parameters (the same DTensors, with the same placements, so mfsdp's sharding, gradient reduction,
clipping and DCP see no difference) but runs the activations as plain local tensors:

* column-parallel linears (q/k/v, gate/up, the head) and row-parallel ones (o, down) compute with
  ``weight.to_local()`` (a view of mfsdp's unsharded buffer, no copy); the gradient comes back as a
  DTensor of the parameter's placements;
* with ``sequence_parallel`` the residual stream is seq-sharded: one all-gather of the normed input
  feeds attention's q, k and v (and one the MLP's gate and up); o and down reduce-scatter. These are
  autograd Functions whose backward is the adjoint (reduce-scatter, all-gather). Without sequence
  parallel: identity forward / all-reduce backward in, all-reduce forward / identity backward out;
* the norms run on the local sequence shard; their weight gradient is declared ``Partial`` over tp
  (each rank saw other tokens, or other heads for Qwen3's q/k norms) and mfsdp all-reduces it once;
* the vocabulary-parallel embedding looks up its own rows and reduce-scatters (all-reduces) the
  sum; the head's logits stay a ``Shard(-1)`` DTensor under ``loss_parallel`` (torch's parallel
  cross-entropy, unchanged) or are all-gathered over the vocabulary;
* between decoder layers (and into the final norm and head) the residual stream is still the
  ``Shard(1)`` DTensor of the DTensor path, so Hugging Face derives positions, rotary tables and the
  causal mask from the full sequence: two cheap wraps per layer instead of hundreds of dispatches.

Hugging Face's own module code runs unchanged on the local tensors (it reshapes with ``-1`` heads),
so only leaf forwards are replaced (the linears, norms, the embedding) and the sub-layer inputs are
converted by forward pre-hooks.
"""

from __future__ import annotations

import collections
import functools
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from mfsdp import _compat
from mfsdp.runtime.geometry import contiguous_stride

# Module roles of the built-in plan (module-name patterns, '*' one name atom), and the placements
# their parameters get: exactly those of ``tp_plans.llama_style_plan`` (a test compares them).
COLWISE, ROWWISE, EMBEDDING, HEAD, NORM, HEAD_NORM, GATHER, LAYER = (
    "colwise", "rowwise", "embedding", "head", "norm", "head_norm", "gather", "layer")
_ROLES = {
    "model.embed_tokens": EMBEDDING, "lm_head": HEAD, "model.norm": NORM, "model.layers.*": LAYER,
    "model.layers.*.input_layernorm": NORM, "model.layers.*.post_attention_layernorm": NORM,
    "model.layers.*.self_attn": GATHER, "model.layers.*.mlp": GATHER,
    "model.layers.*.self_attn.q_proj": COLWISE, "model.layers.*.self_attn.k_proj": COLWISE,
    "model.layers.*.self_attn.v_proj": COLWISE, "model.layers.*.self_attn.o_proj": ROWWISE,
    "model.layers.*.mlp.gate_proj": COLWISE, "model.layers.*.mlp.up_proj": COLWISE,
    "model.layers.*.mlp.down_proj": ROWWISE,
    "model.layers.*.self_attn.q_norm": HEAD_NORM, "model.layers.*.self_attn.k_norm": HEAD_NORM,
}
_PLACEMENTS = {  # role -> {parameter name: placement}; unnamed parameters are replicated
    COLWISE: {"weight": Shard(0), "bias": Shard(0)}, HEAD: {"weight": Shard(0), "bias": Shard(0)},
    EMBEDDING: {"weight": Shard(0)}, ROWWISE: {"weight": Shard(1), "bias": Replicate()},
}


# ------------------------------------------------------------------------------ collectives
def _all_gather(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()  # no copy when the dims before ``dim`` have size 1
    out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    _compat.all_gather_into_tensor(out, x, group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
    _compat.reduce_scatter_tensor(out, x, dist.ReduceOp.SUM, group)
    return out.movedim(0, dim)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


class _Adjoint(torch.autograd.Function):
    """``op`` along ``dim`` in forward, its adjoint in backward: all-gather / reduce-scatter."""

    @staticmethod
    def forward(ctx, x, op, adjoint, dim, group, size):
        ctx.adjoint, ctx.args = adjoint, (dim, group, size)
        return op(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad):
        return ctx.adjoint(grad, *ctx.args), None, None, None, None, None


class _ReduceInGrad(torch.autograd.Function):
    """Identity in forward, all-reduce of the gradient in backward (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceOut(torch.autograd.Function):
    """All-reduce in forward, identity in backward (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)  # in place, as Megatron: x is a fresh partial sum nothing saved

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherVocab(torch.autograd.Function):
    """All-gather of the last dim (the vocabulary) in forward; this rank's slice in backward."""

    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.args = x.shape[-1], rank
        return _all_gather(x, x.ndim - 1, group, size)

    @staticmethod
    def backward(ctx, grad):
        width, rank = ctx.args
        return grad.narrow(-1, rank * width, width).contiguous(), None, None, None


# --------------------------------------------------------------------------------- context
class LocalTP:
    """What the replaced forwards share: the tp group and the two switches."""

    def __init__(self, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
        self.mesh, self.group = tp_mesh, tp_mesh.get_group()
        self.size, self.rank = tp_mesh.size(), tp_mesh.get_local_rank()
        self.sp, self.loss_parallel = sequence_parallel, loss_parallel
        self.seq = [Shard(1)]

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """A block's input as the full local activation its column-parallel linears need."""
        if self.sp:
            return _Adjoint.apply(x, _all_gather, _reduce_scatter, 1, self.group, self.size)
        return _ReduceInGrad.apply(x, self.group)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel partial sum as the block's output (seq-sharded with sequence parallel)."""
        if self.sp:
            return _Adjoint.apply(y, _reduce_scatter, _all_gather, 1, self.group, self.size)
        return _ReduceOut.apply(y, self.group)

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """The seq-sharded residual stream as the ``Shard(1)`` DTensor Hugging Face sees."""
        shape = (local.shape[0], local.shape[1] * self.size) + tuple(local.shape[2:])
        return DTensor.from_local(local, self.mesh, self.seq, run_check=False, shape=torch.Size(shape),
                                  stride=contiguous_stride(shape))

    @property
    def stream_grad(self) -> list:
        """Gradient placement of a replicated weight applied to the residual stream."""
        return [Partial()] if self.sp else [Replicate()]


def _unwrap(x):
    return x.to_local() if isinstance(x, DTensor) else x


# ---------------------------------------------------------------------------- the forwards
def _colwise(tp: LocalTP, module: nn.Linear, x):
    bias = module.bias.to_local() if module.bias is not None else None
    return F.linear(x, module.weight.to_local(), bias)


def _rowwise(tp: LocalTP, module: nn.Linear, x):
    y = tp.leave(F.linear(x, module.weight.to_local()))
    return y if module.bias is None else y + module.bias.to_local(grad_placements=tp.stream_grad)


def _norm(tp: LocalTP, grad_placements, module: nn.Module, x):
    """Hugging Face's RMSNorm (Llama, Mistral, Qwen2/3) on the local tensor."""
    local = _unwrap(x)
    h = local.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    out = module.weight.to_local(grad_placements=grad_placements) * h.to(local.dtype)
    if isinstance(x, DTensor):
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())
    return out


def _embedding(tp: LocalTP, module: nn.Embedding, ids):
    weight = module.weight.to_local()
    rows = weight.shape[0]
    local = ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    pad = module.padding_idx
    pad = pad - tp.rank * rows if pad is not None and 0 <= pad - tp.rank * rows < rows else None
    out = F.embedding(local.masked_fill(outside, 0), weight, pad).masked_fill(outside.unsqueeze(-1), 0)
    out = tp.leave(out)
    return tp.wrap(out) if tp.sp else out


def _head(tp: LocalTP, module: nn.Linear, x):
    logits = _colwise(tp, module, tp.enter(_unwrap(x)))
    if not tp.loss_parallel:
        return _GatherVocab.apply(logits, tp.group, tp.size, tp.rank)
    shape = tuple(logits.shape[:-1]) + (logits.shape[-1] * tp.size,)
    return DTensor.from_local(logits, tp.mesh, [Shard(logits.ndim - 1)], run_check=False,
                              shape=torch.Size(shape), stride=contiguous_stride(shape))


def _map_hidden(fn, args, kwargs):
    """``(args, kwargs)`` with ``fn`` applied to the hidden states (first positional, or by name)."""
    if args:
        return (fn(args[0]),) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}


def _enter_hook(tp: LocalTP, module, args, kwargs):
    return _map_hidden(tp.enter, args, kwargs)


def _layer_in_hook(tp: LocalTP, module, args, kwargs):
    return _map_hidden(_unwrap, args, kwargs)


def _layer_out_hook(tp: LocalTP, module, args, kwargs, output):
    if isinstance(output, tuple):  # older transformers return (hidden_states, ...)
        return (tp.wrap(output[0]),) + tuple(output[1:])
    return tp.wrap(output)


# ---------------------------------------------------------------------------------- apply
def _role(name: str, head_norms: bool) -> Optional[str]:
    atoms = name.split(".")
    for pattern, role in _ROLES.items():
        parts = pattern.split(".")
        if len(parts) == len(atoms) and all(p in ("*", a) for p, a in zip(parts, atoms)):
            return None if role == HEAD_NORM and not head_norms else role
    return None


def check_local_tp(model: nn.Module, tp_size: int) -> None:
    """What the local path needs beyond :func:`~mfsdp.manager.tp_plans.validate_tp`: equal
    vocabulary shards (the head's all-gather and the embedding's row offsets assume them)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and vocab % tp_size:
        raise ValueError(f"tp_activation_path='local' needs vocab_size={vocab} divisible by the tensor-parallel "
                         f"size {tp_size}; pad the vocabulary or use tp_activation_path='dtensor'")


def apply_local_tp(model: nn.Module, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool,
                   head_norms: bool = False) -> nn.Module:
    """Shard the parameters of a Llama-style HF causal LM over ``tp_mesh`` (the placements of the
    built-in DTensor plan, tied weights kept tied) and install the local-tensor forwards."""
    check_local_tp(model, tp_mesh.size())
    tp = LocalTP(tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    done: dict[int, tuple[nn.Parameter, list]] = {}
    seen = collections.Counter()
    for name, module in list(model.named_modules()):
        role = _role(name, head_norms)
        if role is None:
            continue
        seen[role] += 1
        placements = _PLACEMENTS.get(role, {})
        for attr, param in list(module.named_parameters(recurse=False)):
            want = [placements.get(attr, Replicate())]
            if id(param) in done:
                new, had = done[id(param)]
                if had != want:
                    raise NotImplementedError(f"tied parameter {name}.{attr} would need placements {want} here "
                                              f"and {had} elsewhere; untie it or use tp_activation_path='dtensor'")
            else:
                new = nn.Parameter(distribute_tensor(param, tp_mesh, want), requires_grad=param.requires_grad)
                done[id(param)] = new, want
            setattr(module, attr, new)
        _install(tp, role, name, module)
    missing = [r for r in (EMBEDDING, HEAD, COLWISE, ROWWISE, NORM, LAYER) if not seen[r]]
    if missing:
        raise ValueError(f"tp_activation_path='local': {type(model).__name__} lacks the module roles {missing} of "
                         "the Llama-style layout (model.embed_tokens, model.layers.*.self_attn.q_proj, ..., lm_head)")
    return model


_FORWARDS = {COLWISE: _colwise, ROWWISE: _rowwise, EMBEDDING: _embedding, HEAD: _head}


def _install(tp: LocalTP, role: str, name: str, module: nn.Module) -> None:
    if role in (NORM, HEAD_NORM) and not hasattr(module, "variance_epsilon"):
        raise ValueError(f"tp_activation_path='local' runs Hugging Face's RMSNorm; {name} is a "
                         f"{type(module).__name__} without variance_epsilon. Use tp_activation_path='dtensor'")
    if role == GATHER:
        module.register_forward_pre_hook(functools.partial(_enter_hook, tp), with_kwargs=True)
    elif role == LAYER:
        if tp.sp:
            module.register_forward_pre_hook(functools.partial(_layer_in_hook, tp), with_kwargs=True)
            module.register_forward_hook(functools.partial(_layer_out_hook, tp), with_kwargs=True)
    elif role == NORM:
        forward = functools.partial(_norm, tp, tp.stream_grad)
    elif role == HEAD_NORM:  # each rank normalises its own heads: the weight gradient is partial
        forward = functools.partial(_norm, tp, [Partial()])
    else:
        forward = functools.partial(_FORWARDS[role], tp)
    if role not in (GATHER, LAYER):
        module.forward = functools.partial(forward, module)


# --------------------------------------------------------------------------- measurement
def collective_kind(op) -> Optional[str]:
    """``all_gather`` / ``reduce_scatter`` / ``all_reduce`` / ``all_to_all`` / ``broadcast`` /
    ``barrier`` for a c10d or functional collective op (either namespace), None for any other op
    (waits, tensor wrapping)."""
    if getattr(op, "namespace", None) not in ("c10d", "_c10d_functional"):
        return None
    name = op.__name__.split(".")[0].lower().replace("_", "")
    for key, kind in (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
                      ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("barrier", "barrier")):
        if key in name:
            return kind
    return None  # waits, tensor wrapping


class CollectiveCounter(_compat.dispatch_mode_base()):
    """Counts, while active (forward and backward), the collectives issued and the ops dispatched on
    DTensors (each one a trip through DTensor's sharding propagation on the host). DTensor ops are
    let through first (``NotImplemented``) so the collectives they desugar into are counted too."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.dtensor_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(t, type) and issubclass(t, DTensor) for t in types):
            self.dtensor_ops += 1
            return NotImplemented
        kind = collective_kind(func)
        if kind is not None:
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))


def count_forward_backward(forward) -> tuple[CollectiveCounter, CollectiveCounter]:
    """Run ``forward()`` (it returns a loss) and then the loss's backward, each under its own
    :class:`CollectiveCounter`; returns the two counters."""
    counters = CollectiveCounter(), CollectiveCounter()
    with counters[0]:
        loss = forward()
    with counters[1]:
        loss.backward()
    return counters

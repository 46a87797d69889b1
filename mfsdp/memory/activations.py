"""Activations, measured: one short model's forward, loss and backward under ``FakeTensorMode``.

The model is the real one cut to two blocks (``num_hidden_layers=2`` for Hugging Face models). Its
tensors carry shapes and dtypes but no data, so the run takes about a second on CPU even for the
8B shape. A dispatch mode sees every op's outputs and counts the bytes of each new storage until
it is freed; hooks on the blocks (the runtime's own signals: a block's forward, the gradient of its
output, the gradient of its input) cut the run into windows. From the second block, which sits
between two others as every block but the first does, come the bytes a block leaves saved for
backward and the peak transient above that inside its forward and its backward.

Trade-off taken: the attention backend is the one the CPU dispatcher picks for fake CPU tensors
(flash attention for causal SDPA, like CUDA's, saving the output and the log-sum-exp, not the
score matrix). A model whose GPU kernels save something else (a fused kernel with another
recompute policy) is measured as its CPU path. Rejected: counting saved tensors by formula (it
must know every model), and tracing the full-depth model (seconds per setting for the 8B shape,
and a block's numbers do not depend on depth).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mfsdp import _compat
from mfsdp.models.llama import IGNORE_INDEX
from mfsdp.models.outputs import logits_of
from mfsdp.runtime import gather_codec


@dataclasses.dataclass(frozen=True)
class StepRun:
    """What a training step runs on a microbatch when it is not the causal language model's loss
    (``labels_run``, ``cross_entropy_run``): another objective's (``Objective.step_run``), measured as it is."""

    label: str
    """What the plan's first line calls it."""
    run: Callable[[torch.Tensor], Callable[[nn.Module], torch.Tensor]]
    """(fake tokens, batch x seq) -> a run for ``measure``: the model's forward passes, the loss."""
    note: str = ""
    """What the estimate says of how it is planned."""


@dataclasses.dataclass(frozen=True)
class ActivationProfile:
    """Measured activation bytes of one microbatch, for one rank (batch and sequence given)."""

    embed_bytes: int
    """Live after the layers before the first block (embedding output and what it saved)."""
    block_bytes: int
    """What one block adds to the live bytes in forward: the tensors it saved plus its output,
    less nothing (its input stays referenced by the previous block)."""
    block_forward_transient: int
    """Peak above a block's end-of-forward bytes while its forward runs."""
    block_backward_peak: int
    """Peak above the live bytes at the start of a block's backward, while it runs (activation
    gradients, recompute under checkpointing, and the block's own weight gradients then live)."""
    block_weight_grad_bytes: int
    """Weight-gradient bytes of one block counted in ``block_backward_peak`` at its peak."""
    head_forward_bytes: int
    """Live bytes the layers after the last block and the loss add by the end of forward: what the
    loss saved for backward (the plain loss's fp32 log-softmax, the fused loss's head gradients),
    and the logits where the loop keeps them."""
    head_forward_transient: int
    """Peak above the end-of-forward bytes while the head and the loss run forward."""
    loss_backward_peak: int
    """Peak above the end-of-forward bytes while the loss runs backward (until the model's output
    has its gradient); nothing for a model whose forward returns the loss (the bundled Llama with
    labels), whose loss runs backward with its head."""
    head_backward_peak: int
    """Activations above the end-of-forward bytes at the highest point (activations and weight
    gradients) of the head's backward, a loss computed in the head included."""
    head_weight_grad_bytes: int
    """Weight-gradient bytes that arrived in the head's backward by that point (a weight gradient
    made but not yet accumulated counts as an activation)."""
    embed_backward_peak: int
    """Peak above the block-free bytes while the layers before the first block run backward, weight
    gradients excluded."""
    grad_window: dict
    """Parameter name -> the backward window its gradient arrives in ("head", "blocks", "embed")."""


def _storages(t: torch.Tensor) -> list:
    """The storages holding a tensor's bytes. A wrapper subclass (a tensor-parallel DTensor, the
    ``AsyncCollectiveTensor`` a functional collective returns) has none of its own: its inner
    tensors (``__tensor_flatten__``, the subclass protocol) hold them."""
    if getattr(type(t), "__tensor_flatten__", None) is None:
        return [t.untyped_storage()]
    inner = [getattr(t, name) for name in t.__tensor_flatten__()[0]]
    return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]


def _tensors(tree) -> list:
    """The tensors among a pytree's leaves."""
    return [x for x in _compat.tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


_WAIT = torch.ops._c10d_functional.wait_tensor.default
_ROUTING_OPS = (torch.ops.aten.bincount.default, torch.ops.aten._local_scalar_dense.default)


def _detached_collective(func, args, kwargs):
    """``func`` on copies of its tensors, waited, its outputs copied: gloo's work then holds only
    tensors outside the count (see ``measure``'s ``real_collectives``)."""
    leaves, spec = _compat.tree_flatten((args, kwargs))
    args, kwargs = _compat.tree_unflatten([x.clone() if isinstance(x, torch.Tensor) else x for x in leaves], spec)
    leaves, spec = _compat.tree_flatten(func(*args, **kwargs))
    return _compat.tree_unflatten([_WAIT(x).clone() if isinstance(x, torch.Tensor) else x for x in leaves], spec)


class _LiveBytes(_compat.dispatch_mode_base()):
    """Counts the bytes of every storage an op creates until it is freed; ``mark`` records the
    counters under a label."""

    def __init__(self, uniform_routing: bool = False, real_collectives: bool = False) -> None:
        super().__init__()
        self.uniform_routing = uniform_routing
        self.real_collectives = real_collectives
        self._counts: dict[int, list[int]] = {}  # storage -> the assumed routing counts
        self.act = 0  # storages that are not parameter gradients
        self.grad = 0  # parameter gradients (moved here when accumulated)
        self._sizes: dict[int, int] = {}
        self._is_grad: set[int] = set()
        self.timeline: list[tuple[int, int]] = []
        self.marks: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.uniform_routing and func in _ROUTING_OPS:
            routed = self._route(func, args, kwargs or {})
            if routed is not None:
                return routed
        inputs = {id(st) for t in _tensors((args, kwargs)) for st in _storages(t)}
        if self.real_collectives and func.namespace == "_c10d_functional" and func is not _WAIT:
            out = _detached_collective(func, args, kwargs or {})
        else:
            out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            for storage in _storages(t):
                key = id(storage)
                if key in self._sizes or key in inputs:
                    continue  # a view or an in-place result: no new bytes
                self._sizes[key] = storage.nbytes()
                self.act += storage.nbytes()
                weakref.finalize(storage, self._free, key)
        self.timeline.append((self.act, self.grad))
        return out

    def _route(self, func, args, kwargs):
        """Token routing is data: ``bincount`` of the (token, slot) -> expert assignments returns
        the uniform counts (``assignments / bins`` each, the remainder to the first bins), and
        reading them (``tolist``, ``item``) gives those values."""
        if func is torch.ops.aten.bincount.default:
            flat = args[0]
            bins = max(kwargs.get("minlength", args[2] if len(args) > 2 else 0), 1)
            n = flat.numel()
            out = torch.empty(bins, dtype=torch.long, device=flat.device)
            self._counts[id(out.untyped_storage())] = [n // bins + (i < n % bins) for i in range(bins)]
            return out
        t = args[0]
        counts = self._counts.get(id(t.untyped_storage()))
        return None if counts is None else counts[t.storage_offset()]  # None: not the counts

    def _free(self, key: int) -> None:
        size = self._sizes.pop(key, 0)
        if key in self._is_grad:
            self._is_grad.discard(key)
            self.grad -= size
        else:
            self.act -= size

    def mark_grad(self, tensor: torch.Tensor) -> None:
        for storage in _storages(tensor):
            key = id(storage)
            if key in self._sizes and key not in self._is_grad:
                self._is_grad.add(key)
                self.act -= self._sizes[key]
                self.grad += self._sizes[key]

    def mark(self, label: str) -> None:
        self.timeline.append((self.act, self.grad))
        self.marks[label] = len(self.timeline) - 1

    def at(self, label: str) -> tuple[int, int]:
        return self.timeline[self.marks[label]]

    def window(self, start: str, stop: str) -> list[tuple[int, int]]:
        """The counters from one mark to another, both included."""
        return self.timeline[self.marks[start]:self.marks[stop] + 1]

    def peak(self, start: str, stop: str) -> int:
        """Highest live bytes (parameter gradients not counted) between two marks."""
        return max(a for a, _ in self.window(start, stop))


def measure(model: nn.Module, blocks: list[nn.Module], run: Callable[[nn.Module], torch.Tensor],
            names: Optional[dict] = None, uniform_routing: bool = False,
            real_collectives: bool = False) -> ActivationProfile:
    """Run ``run(model)`` (forward and loss) and its backward on the fake ``model`` (at least two
    ``blocks``, in forward order) and cut the live bytes into an ``ActivationProfile``.

    ``uniform_routing``: the model routes tokens by ``torch.bincount`` of its expert choices, read
    on the host (``mfsdp.models.moe``); every expert then gets an equal share (see ``_route``).

    ``real_collectives``: the model runs real tensors over a real process group (a check of the
    fake measurement). A gloo collective's output is then also held by the finished work on gloo's
    worker thread, which drops it a moment after the wait returns, or, on a loaded machine, after
    the next mark: its free would land in a window decided by the scheduler. Each collective is
    therefore run on copies of its inputs, waited at once and its outputs copied, all outside the
    count, so the bytes counted die where the model drops them, as on the fake group."""
    if len(blocks) < 2:
        raise ValueError("activation measurement needs a model of at least two blocks")
    try:
        return _measure(model, blocks, run, names, _LiveBytes(uniform_routing, real_collectives))
    except Exception as err:  # torch's DynamicOutputShapeException / DataDependentOutputException
        if "DynamicOutputShape" in type(err).__name__ or "DataDependent" in type(err).__name__:
            raise NotImplementedError(
                f"cannot measure this model's activations on fake tensors: its forward has data-dependent "
                f"shapes ({err}), as token routing in a mixture of experts does (the bundled MoE is "
                "measured with uniform routing); estimate a dense model, or skip the check "
                "(mfsdp train --train.skip_memory_check true)") from None
        raise


def _measure(model, blocks, run, names, tracker) -> ActivationProfile:
    window = {"now": "head"}
    names = names or {id(p): n for n, p in model.named_parameters()}
    arrival: dict[str, str] = {}

    def on_grad(param):
        tracker.mark_grad(param.grad)
        arrival[names.get(id(param), "?")] = window["now"]

    handles = [p.register_post_accumulate_grad_hook(on_grad) for p in model.parameters() if p.requires_grad]

    def root_output(module, args, output):  # the logits, or the loss of a model that computes it
        out = next((t for t in _tensors(logits_of(output)) if t.requires_grad), None)
        if out is not None:
            out.register_hook(lambda grad: tracker.mark("loss_backward_end"))
    handles.append(model.register_forward_hook(root_output))
    for i, block in enumerate(blocks):
        entering, leaving = _block_marks(tracker, i, window)
        handles += [block.register_forward_pre_hook(entering), block.register_forward_hook(leaving, with_kwargs=True)]
    try:
        with tracker:
            tracker.mark("start")
            loss = run(model)
            tracker.mark("forward_end")
            loss.backward()
            tracker.mark("backward_end")
            getattr(run, "kept", []).clear()
    finally:
        for h in handles:
            h.remove()
    act = lambda label: tracker.at(label)[0]  # noqa: E731
    enter_act, enter_grads = tracker.at("bwd_enter_1")
    last = len(blocks) - 1
    # The second block's backward peaks where activations and the weight gradients so far are highest.
    peak_act, peak_grads = max(tracker.window("bwd_enter_1", "bwd_exit_1"), key=sum)
    head_act, head_grads = max(tracker.window("loss_backward_end", f"bwd_enter_{last}"), key=sum)
    return ActivationProfile(
        embed_bytes=act("fwd_enter_0") - act("start"),
        block_bytes=act("fwd_exit_1") - act("fwd_enter_1"),
        block_forward_transient=tracker.peak("fwd_enter_1", "fwd_exit_1") - act("fwd_exit_1"),
        block_backward_peak=peak_act + peak_grads - enter_act - enter_grads,
        block_weight_grad_bytes=peak_grads - enter_grads,
        head_forward_bytes=act("forward_end") - act(f"fwd_exit_{last}"),
        head_forward_transient=tracker.peak(f"fwd_exit_{last}", "forward_end") - act("forward_end"),
        loss_backward_peak=tracker.peak("forward_end", "loss_backward_end") - act("forward_end"),
        head_backward_peak=head_act - act("forward_end"),
        head_weight_grad_bytes=head_grads - tracker.at("loss_backward_end")[1],
        embed_backward_peak=tracker.peak("bwd_exit_0", "backward_end") - act("bwd_exit_0"),
        grad_window=arrival,
    )


def _block_marks(tracker, i, window):
    """Block ``i``'s forward pre-hook and forward hook: they mark its forward's start and end (the
    first time: a recompute under checkpointing marks nothing), and the latter hooks its output's
    and input's gradients to mark its backward's."""

    def entering(module, args):
        if torch.is_grad_enabled() and f"fwd_enter_{i}" not in tracker.marks:
            tracker.mark(f"fwd_enter_{i}")

    def leaving(module, args, kwargs, output):
        if f"fwd_exit_{i}" in tracker.marks:
            return
        tracker.mark(f"fwd_exit_{i}")
        out = output[0] if isinstance(output, (tuple, list)) else output
        inputs = [a for a in _tensors((args, kwargs)) if a.requires_grad]

        def entered(grad):
            window["now"] = "blocks"
            tracker.mark(f"bwd_enter_{i}")

        def exited(grad):
            tracker.mark(f"bwd_exit_{i}")
            if i == 0:
                window["now"] = "embed"
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(entered)
        if inputs:
            inputs[0].register_hook(exited)
    return entering, leaving


# ------------------------------------------------------------------------------ model builders
def labels_run(tokens: torch.Tensor) -> Callable[[nn.Module], torch.Tensor]:
    """What ``mfsdp train`` runs on the bundled Llama (``mfsdp.train.objectives.causal_lm``): the labels
    through the model's forward, whose head computes the loss sum with the model's ``loss_fn``
    (``Llama.set_head_loss``); nothing else stays referenced into backward."""
    return lambda model: model(tokens, labels=tokens)[0]


def cross_entropy_run(tokens: torch.Tensor) -> Callable[[nn.Module], torch.Tensor]:
    """A model that returns logits (Hugging Face's): its logits, upcast, against shifted targets, as
    the benchmarks' loops run it (``benchmarks/memory_accuracy.py``). The logits stay referenced
    through backward, as those loops' local variable keeps them."""
    kept = []

    def run(model):
        kept.clear()
        logits = model(tokens)
        logits = logits_of(logits)
        kept.append(logits)
        return F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    run.kept = kept
    return run


class CompiledPlainLoss(torch.autograd.Function):
    """What the compiled plain head loss (``mfsdp.models.llama.compiled_head_loss("plain")``) holds,
    for measuring on fake tensors, where inductor cannot run: its forward keeps the compute-dtype
    logits and nothing in fp32 (the upcast and the log-softmax are fused into one reduction); its
    backward makes the logits' gradient in the compute dtype, drops the logits, then runs the two
    GEMMs. On one H200 at 4,096 tokens and a 128,256 vocabulary (``benchmarks/loss_bench.py``,
    plain_compiled) the head's forward and backward peaked 1.99 GiB above their inputs: the logits'
    gradient and the weight's, as here."""

    @staticmethod
    def forward(ctx, hidden, weight, labels):
        ctx.logits = [F.linear(hidden, weight)]  # not saved_tensors: the backward drops it early
        ctx.save_for_backward(hidden, weight)
        return hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_sum):
        hidden, weight = ctx.saved_tensors
        grad_logits = torch.empty_like(ctx.logits.pop())
        grad_hidden = grad_logits @ weight
        if not ctx.needs_input_grad[1]:  # a frozen head (LoRA): the compiled backward makes no weight gradient
            return grad_hidden, None, None
        grad_weight = grad_logits.flatten(0, -2).t() @ hidden.flatten(0, -2)
        return grad_hidden, grad_weight, None


def compiled_plain_loss(hidden, weight, labels):
    """``plain_linear_cross_entropy``'s signature over ``CompiledPlainLoss``: (fp32 sum, int64 count)."""
    return CompiledPlainLoss.apply(hidden, weight, labels), (labels != IGNORE_INDEX).sum()


def measure_llama(cfg, dtype: torch.dtype, batch: int, seq: int, checkpointing: bool, head_loss: str = "plain",
                  compiled_head: bool = False, block: Optional[nn.Module] = None,
                  step_run: Optional[StepRun] = None) -> ActivationProfile:
    """A bundled Llama (or MoE) shape, cut to two blocks, measured on fake tensors as ``mfsdp train``
    runs it (``labels_run``) with ``head_loss`` (``Llama.set_head_loss``), compiled with the blocks
    where ``compiled_head`` (the plain loss then as ``CompiledPlainLoss``; the fused one as its eager
    self, an upper bound). ``block``: a block of the model as it trains (the model transforms applied,
    on the meta device), whose fake copies (``gathered_copy``: weights as the runtime's gathers hand
    them) are the two blocks; None: the blocks ``cfg`` builds. ``step_run``: another objective's step."""
    from mfsdp.models import build_model

    small = dataclasses.replace(cfg, n_layers=2, max_seq_len=max(cfg.max_seq_len, seq))
    with _compat.fake_tensor_mode():
        model = build_model(small, dtype=dtype)
        if block is not None:
            model.layers = nn.ModuleList([gathered_copy(block), gathered_copy(block)])
        model.set_activation_checkpointing(checkpointing)
        model.set_head_loss(head_loss)
        if compiled_head and head_loss == "plain":
            model.loss_fn = compiled_plain_loss
        tokens = torch.zeros(batch, seq, dtype=torch.long)
        run = labels_run(tokens) if step_run is None else step_run.run(tokens)
        return measure(model, list(model.layers), run, uniform_routing=cfg.num_experts > 0)


def block_kind(block: nn.Module) -> tuple:
    """What sets a block's activations apart from another's of the same shape: its modules' types and
    settings, its parameters' dtypes, ``requires_grad`` and gather-codec specs. Model transforms that
    treat blocks differently (``Float8Transform.skip``) make blocks of several kinds."""
    return (tuple((name, type(m).__qualname__, m.extra_repr()) for name, m in block.named_modules()),
            tuple((name, p.dtype, p.requires_grad, gather_codec.spec_of(p)) for name, p in block.named_parameters()))


def gathered_copy(block: nn.Module) -> nn.Module:
    """A copy of ``block`` (on the meta device, or any) over new CPU tensors (fake ones under a fake
    mode), its tagged weights (a gather codec's: FP8 all-gather) as the runtime's gather hands them:
    their codec (``CodecSpec.build`` of their specs, ``wrap``) builds each one's compute parameter
    over a tensor of the wire dtype, so torchao casts no weight in forward or backward, and what it
    saves for backward is the gathered weight (counted as model state), as in a sharded run."""
    from mfsdp.mixed_precision import MixedPrecisionPolicy

    copied = copy.deepcopy(block)
    for module, source in zip(copied.modules(), block.modules()):
        for key, param in source.named_parameters(recurse=False):
            setattr(module, key, nn.Parameter(torch.empty_like(param, device="cpu"), param.requires_grad))
        for key, buffer in source.named_buffers(recurse=False):
            setattr(module, key, torch.empty_like(buffer, device="cpu"))
    tagged = [(name, p) for name, p in block.named_parameters() if gather_codec.spec_of(p) is not None]
    specs = [gather_codec.spec_of(p) for _, p in tagged]
    codec = specs and specs[0].build(specs, MixedPrecisionPolicy().resolve(tagged[0][1].dtype), "measured block")
    for k, (name, param) in enumerate(tagged):
        owner, _, attr = name.rpartition(".")
        view = torch.zeros(param.shape, dtype=codec.wire_dtype, device="cpu")
        setattr(copied.get_submodule(owner), attr, codec.wrap(k, copied.get_parameter(name), view))
    return copied


def measure_hf(config, dtype: torch.dtype, batch: int, seq: int, checkpointing: bool,
               unit_names: Optional[list] = None, tp=None, tp_mesh=None,
               step_run: Optional[StepRun] = None) -> ActivationProfile:
    """A Hugging Face causal LM (its ``config``), cut to two decoder layers, on fake tensors;
    checkpointing wraps each layer as the manager does. With ``tp`` (a ``TensorParallel`` of size
    > 1) the manager's plan is applied first over ``tp_mesh`` (a fake ``tp`` mesh, see
    ``tensor_parallel``), so every block runs with its TP-local weights and, under sequence
    parallel, seq / tp tokens between sub-layers; the loss runs in ``loss_parallel()`` when asked.
    ``step_run``: another objective's step, in place of the cross entropy."""
    import transformers

    from mfsdp.manager.core_options import checkpoint_forward, resolve_unit_modules
    from mfsdp.manager.tp_plans import loss_context
    from mfsdp.memory.tensor_parallel import apply_tp

    config = copy.deepcopy(config)
    config.num_hidden_layers = 2
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:2]
    config.use_cache = False
    with _compat.fake_tensor_mode():
        with torch.device("cpu"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        tp_on = tp is not None and tp.enabled
        if tp_on:
            apply_tp(model, tp, tp_mesh)
        units = [m for _, m in resolve_unit_modules(model, unit_names)][::-1]  # forward order
        if checkpointing:
            for unit in units:
                checkpoint_forward(unit)
        tokens = torch.zeros(batch, seq, dtype=torch.long)
        with loss_context(tp_on and tp.loss_parallel), _unpacked_sequences():
            return measure(model, units, cross_entropy_run(tokens) if step_run is None else step_run.run(tokens))


@contextlib.contextmanager
def _unpacked_sequences():
    """Hugging Face's masks take fake position ids for packed sequences (they cannot read them) and
    build a seq x seq mask that every layer then saves; the training loop's rows are single
    sequences, for which a real run finds no packing and lets SDPA run causal without a mask. Say
    so to the mask code while measuring (transformers >= 5; older versions lack the function)."""
    from unittest import mock

    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    with (mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
          if hasattr(masking_utils, "find_packed_sequence_indices") else contextlib.nullcontext()):
        yield

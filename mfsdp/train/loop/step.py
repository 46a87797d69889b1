"""One optimizer step of ``mfsdp train``: the learning rate, the microbatches' forward and backward,
clipping, the update, and the step's scalars (``StepOutput``) in one collective."""

from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from typing import Callable

import torch
import torch.distributed as dist

import mfsdp
from mfsdp.data import Batch
from mfsdp.train.run.config import TrainSection


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """A step's scalars: 0-dim device tensors as ``train_step`` returns them, floats once read back
    one step late (``unpack``); ``pack`` and ``unpack`` agree on the order, here only."""

    metrics: dict
    """The objective's metrics by name: each the mean over the count of the global batch (the sum
    over the global batch and every rank until ``unpack``)."""
    stop_votes: object
    """How many ranks asked to stop (Ctrl-C, SIGTERM) before this step."""
    aux_loss: object
    """A mixture of experts' load-balancing loss, unweighted, the mean over the global batch."""
    grad_norm: object
    """The global gradient norm before clipping."""

    def pack(self) -> torch.Tensor:
        values = (*self.metrics.values(), self.stop_votes, self.aux_loss, self.grad_norm)
        return torch.stack([v.to(torch.float32).reshape(()) for v in values])

    @classmethod
    def unpack(cls, values: list[float], names: tuple[str, ...], world: int, count: int) -> "StepOutput":
        *sums, votes, aux, norm = values
        return cls({name: value / count for name, value in zip(names, sums)}, votes, aux / world, norm)


def lr_at(t: TrainSection, step: int) -> float:
    """The learning rate of optimizer step ``step`` (1 to ``t.steps``): a linear warm-up to ``t.lr``
    at step ``warmup_steps``, then ``t.lr_schedule``: a half cosine or a straight line down to
    ``min_lr_ratio * lr`` at the last step, or ``lr`` to the end (constant)."""
    if step <= t.warmup_steps:
        return t.lr * step / max(1, t.warmup_steps)
    if t.lr_schedule == "constant":
        return t.lr
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    left = 1 - progress if t.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * left)


def train_step(model, optimizer, objective, batch: Callable[[int], Batch], microbatches: int, count: int, lr: float,
               grad_clip: float, aux_coef: float | None, stop_requested: bool, device: torch.device) -> StepOutput:
    """Forward and backward of ``objective`` over ``microbatches`` batches (``batch(i)``), clip, step;
    returns the step's scalars, reduced over ranks in one all-reduce. ``count``: what the objective
    counts in the whole global batch (``objective.global_count``); ``aux_coef``: the weight of a
    mixture of experts' load-balancing loss (None: the model has none).

    The loss is the mean over the global batch's count, not a mean of per-microbatch means: each
    microbatch's summed loss is scaled by ``world / count`` (the gradient reduction averages over
    ranks), so accumulation and data parallelism give the full batch's gradient whatever share of
    the count each window holds."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    scale = dist.get_world_size() / count
    sums = {name: torch.zeros((), device=device) for name in objective.metrics}
    aux_sum = torch.zeros((), device=device)
    for micro in range(microbatches):
        with torch.profiler.record_function("mfsdp.train.data"):
            b = batch(micro)
        # Without accumulation there is nothing to defer, so skip the context.
        accumulate = (mfsdp.microbatch(model, is_last=micro == microbatches - 1) if microbatches > 1
                      else nullcontext())
        with accumulate, torch.profiler.record_function("mfsdp.train.forward_backward"):
            loss, _, metrics = objective(model, b, device)
            total = loss * scale
            if aux_coef is not None:  # plus the weighted load-balancing loss, a per-microbatch mean
                aux = model.aux_loss()
                total = total + aux_coef * aux / microbatches
                aux_sum += aux.detach() / microbatches
            total.backward()
        for name, value in metrics.items():
            sums[name] += value.detach()
    with torch.profiler.record_function("mfsdp.train.optimizer_step"):
        grad_norm = clip_gradients(model, grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # One collective carries the metrics for logging and every rank's stop request.
    shared = torch.stack([*sums.values(), torch.full((), float(stop_requested), device=device), aux_sum])
    dist.all_reduce(shared)
    return StepOutput(dict(zip(sums, shared[:-2])), shared[-2], shared[-1], grad_norm.to(device, torch.float32))


def clip_gradients(model, grad_clip: float) -> torch.Tensor:
    """The global gradient norm (logged every step), clipping to ``grad_clip`` when positive: one
    plain tensor (``global_grad_norm``), each mesh's gradients scaled by it."""
    by_mesh: dict = {}  # the parameters with a gradient, by its device mesh (None: plain tensors), in order
    for q in model.parameters():
        if (grad := q.grad) is not None:
            by_mesh.setdefault(getattr(grad, "device_mesh", None), []).append(q)
    grad_norm = global_grad_norm(by_mesh)
    if grad_clip > 0:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm)
    return grad_norm


def global_grad_norm(by_mesh: dict) -> torch.Tensor:
    """The 2-norm of every gradient of ``by_mesh`` (parameters by the mesh of their gradients), as a
    plain tensor. Sharded gradients are DTensors, and those of one mesh reduce together: one total
    norm per mesh (a DTensor until ``full_tensor``, one reduction), then the norm of those. With
    expert parallelism the experts' gradients live on the experts' mesh (``mfsdp.experts``), which
    torch cannot stack with the dense ones; with one mesh this is torch's own total norm."""
    norms = []
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([q.grad for q in params])
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if len(norms) <= 1:
        return norms[0] if norms else torch.nn.utils.get_total_norm([])
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))

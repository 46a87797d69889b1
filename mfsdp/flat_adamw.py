"""AdamW on a parameter group's flat buffers: one fused pass over the whole group.

[Note: the flat AdamW step]
torch's fused AdamW steps a list of tensors: it wants gradients in the weights' dtype, so a group
with bf16 main gradients is first upcast to fp32 (one more pass, and the group's fp32 gradient as
a transient), and its chunked multi-tensor kernel moves the group's bytes well under the copy
bandwidth. A group's main weights, main gradient and (here) optimizer states are each one flat
buffer with one layout, so the whole update is one elementwise pass over four aligned buffers:
read the weights, the gradient in its own dtype and both moments, write back the weights and the
moments (26 bytes per fp32 weight with bf16 gradients, against 28 plus the 6-byte upcast before).
On CUDA the pass is one ``torch.compile``d kernel; elsewhere the same function runs eagerly.

The moments stay torch's: ``optimizer.state[p]["exp_avg"]`` and ``["exp_avg_sq"]`` are views of the
flat moments, ``["step"]`` a view of one per-group counter, so ``state_dict``, DCP and torch's own
step (which the group falls back to) read and write the same memory. A load replaces those
tensors (``load_state_dict``'s post hook says so); the next step adopts the loaded values into
new flat buffers (one copy).

When a group steps flat: the optimizer is ``torch.optim.AdamW`` without amsgrad, maximize or
differentiable, it holds all the group's parameters (in one or more param groups: each run of
consecutive members in one param group is one pass with its settings), every one of them carries
the gradient the runtime exposed (none missing, none replaced by the user), their step counts
agree, and the main weights are fp32. Otherwise torch's body steps it, as before.

Numerics: torch's AdamW formula, in fp32, with the gradient upcast in registers and the step's
scalars (bias corrections, decay) computed in double on the host, as torch's foreach step does.
Exact AdamW; the roundings may differ from torch's kernels in the last bit, as fused and foreach do.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["adamw_update", "FlatAdamW"]


def adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 scalars: torch.Tensor, beta1: float, beta2: float, eps: float) -> None:
    """One AdamW update of flat fp32 ``param``, ``exp_avg``, ``exp_avg_sq`` in place, from ``grad``
    (any float dtype). ``scalars``: fp32 (1 - lr * weight_decay, lr / bias_correction1,
    sqrt(bias_correction2)) on the device (``step_scalars``), so a compiled update never sees a
    changing Python number."""
    g = grad.float()
    param.mul_(scalars[0])
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / scalars[2]).add_(eps)
    param.sub_(exp_avg / denom * scalars[1])


def step_scalars(lr: float, weight_decay: float, beta1: float, beta2: float, step: int) -> list[float]:
    """``adamw_update``'s scalars for ``step`` (counted from 1), in double precision as torch computes
    them: ``1 - beta2 ** step`` in fp32 would lose about 1e-5 of its value to cancellation at
    beta2 = 0.999, an error of the update's size, not of its last bit."""
    return [1 - lr * weight_decay, lr / (1 - beta1 ** step), math.sqrt(1 - beta2 ** step)]


_COMPILED: dict[str, Callable] = {}


def _update_for(device: torch.device) -> Callable:
    """``adamw_update`` compiled for CUDA (one kernel per group size), eager elsewhere."""
    if device.type != "cuda":
        return adamw_update
    if "cuda" not in _COMPILED:
        _COMPILED["cuda"] = torch.compile(adamw_update, dynamic=True, fullgraph=True)
    return _COMPILED["cuda"]


def _runs(group, entries: list[tuple[int, list]]) -> list[tuple[int, int, int]]:
    """(param group index, start, stop) of each run of consecutive members of ``group`` in one param
    group of the optimizer, as element ranges of the group's flat optimizer-level buffers."""
    index_of = {id(p): index for index, params in entries for p in params}
    runs: list[list[int]] = []
    start = 0
    for p, region in zip(group.sharded_params, group.layout.regions(group.main.tensor, group.geometry.num_shards)):
        stop = start + region.numel()
        index = index_of[id(p)]
        if runs and runs[-1][0] == index:
            runs[-1][2] = stop
        else:
            runs.append([index, start, stop])
        start = stop
    return [tuple(r) for r in runs]


class _GroupState:
    """One parameter group's flat moments and step counter, and the state entries that view them."""

    def __init__(self, group, state: dict) -> None:
        params, main = group.sharded_params, group.main.tensor
        self.exp_avg = torch.zeros_like(main)
        self.exp_avg_sq = torch.zeros_like(main)
        self.steps = torch.zeros(len(params), dtype=torch.float32, device=main.device)
        layout, geometry = group.layout, group.geometry
        views = {}
        for name, flat in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            views[name] = layout.shards(layout.regions(flat, geometry.num_shards), geometry.shard_index)
        for i, p in enumerate(params):
            old = state.get(p) or {}
            entry = {"step": self.steps[i]}
            for name in ("exp_avg", "exp_avg_sq"):
                local = views[name][i]
                if name in old:  # a state torch's body made, or a load: its values move into the flat buffer
                    local.copy_(old[name].to_local() if isinstance(old[name], DTensor) else old[name])
                entry[name] = (DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                                  shape=p.shape, stride=p.stride())
                               if isinstance(p, DTensor) else local.view(p.shape))
            if "step" in old:
                self.steps[i].copy_(old["step"])
            state[p] = entry
        self.checked = False  # whether the step counts were seen to agree since torch's body last stepped
        self.host_step = 0  # the members' step count, read at each check (the scalars need it on the host)

    def uniform_step(self) -> bool:
        """Whether every member has taken the same number of steps (one host sync, at adoption and
        after torch's body stepped the group)."""
        self.checked = True
        if not self.steps.numel():
            return True
        self.host_step = int(self.steps[0].item())
        return bool((self.steps == self.steps[0]).all())


class FlatAdamW:
    """The flat step of one bound optimizer's groups (see the note above)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._states: dict[int, _GroupState] = {}
        self._refused: set[int] = set()  # groups whose step counts diverged: torch's body steps them
        self._scalars: dict[tuple, tuple[list[float], torch.Tensor]] = {}  # (index, device) -> values, tensor
        self._runs: dict[int, tuple] = {}  # id(group) -> (its entries, its runs)
        # A load replaces the state entries that view the flat buffers: the next step adopts the
        # loaded values into new ones (and the old buffers go with the old entries).
        optimizer.register_load_state_dict_post_hook(lambda opt: self._states.clear())

    @staticmethod
    def supports(optimizer: torch.optim.Optimizer) -> bool:
        """Whether the optimizer's class and settings allow flat steps at all."""
        if type(optimizer) is not torch.optim.AdamW:
            return False
        return not any(pg.get("amsgrad") or pg.get("maximize") or pg.get("differentiable")
                       for pg in optimizer.param_groups)

    def can_step(self, group, entries: list[tuple[int, list]]) -> bool:
        """Whether ``group`` steps flat now: every parameter of it in the optimizer, each with the
        runtime's gradient, fp32 main weights, and step counts that agree."""
        if id(group) in self._refused or group.dtypes.main != torch.float32:
            return False
        reducer = group.reducer
        if sum(len(params) for _, params in entries) != len(group.sharded_params) or reducer.main_grad is None \
                or not reducer.main_grad.is_allocated:
            return False
        exposed = reducer.exposed_gradients()
        return len(exposed) == len(group.sharded_params) and all(
            p.grad is mine for p, mine in zip(group.sharded_params, exposed))

    def step(self, group, entries: list[tuple[int, list]]) -> bool:
        """Step ``group`` flat, one pass per run of consecutive members that share a param group (a
        block's matrices, then its norms, where those are not decayed); False where its step counts
        diverged (torch's body steps it instead)."""
        state = self._states.get(id(group))
        if state is None:
            state = self._states[id(group)] = _GroupState(group, self.optimizer.state)
        if not state.checked and not state.uniform_step():
            self._refused.add(id(group))
            return False
        state.steps.add_(1)
        state.host_step += 1
        main, grad = group.main.tensor, group.reducer.main_grad.tensor
        update = _update_for(main.device)
        cached = self._runs.get(id(group))
        if cached is None or cached[0] is not entries:  # the param groups changed (add_param_group)
            cached = self._runs[id(group)] = (entries, _runs(group, entries))
        for index, start, stop in cached[1]:
            pg = self.optimizer.param_groups[index]
            beta1, beta2 = pg["betas"]
            scalars = step_scalars(float(pg["lr"]), float(pg["weight_decay"]), float(beta1), float(beta2),
                                   state.host_step)
            update(main[start:stop], grad[start:stop], state.exp_avg[start:stop], state.exp_avg_sq[start:stop],
                   self._scalars_tensor(index, scalars, main.device), float(beta1), float(beta2), float(pg["eps"]))
        return True

    def stepped_by_torch(self, group) -> None:
        """torch's body stepped ``group`` (a missing gradient, say): its members' step counts may
        differ now, which the group's next flat step checks first."""
        state = self._states.get(id(group))
        if state is not None:
            state.checked = False

    def _scalars_tensor(self, index: int, scalars: list[float], device: torch.device) -> torch.Tensor:
        """Param group ``index``'s ``step_scalars`` in a device tensor of its own, written in stream
        order and only when they change (once a step for all the groups of a param group), with no
        host sync."""
        values, t = self._scalars.get((index, device), (None, None))
        if t is None:
            t = torch.empty(3, dtype=torch.float32, device=device)
        if values != scalars:
            t.copy_(torch.tensor(scalars, dtype=torch.float32), non_blocking=True)
            self._scalars[(index, device)] = (scalars, t)
        return t


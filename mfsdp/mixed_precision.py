"""Mixed-precision policy: which dtype the main weights, gradients and reductions use."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

_SUPPORTED = (torch.float32, torch.bfloat16)


def _check(dtype: Optional[torch.dtype], field: str) -> None:
    if dtype is None or dtype in _SUPPORTED:
        return
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"MixedPrecisionPolicy.{field} must be a torch.dtype or None, got {dtype!r}")
    raise NotImplementedError(f"MixedPrecisionPolicy.{field}={dtype} is not supported; use torch.float32 or "
                              "torch.bfloat16 (fp16 needs loss scaling, which mfsdp does not do)")


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the copies a sharded parameter keeps.

    Compute always runs in the dtype of the user's module (bf16 or fp32). Where two of the dtypes
    below are equal, the copies share storage: an fp32 model with the default policy keeps one copy
    of its weights, not two.
    """

    main_params_dtype: Optional[torch.dtype] = torch.float32
    """Dtype of the main weights the optimizer updates. None: the compute weights are the main
    weights (no separate copy; cheapest, but a bf16 model then takes bf16 optimizer steps)."""
    main_grads_dtype: Optional[torch.dtype] = None
    """Dtype in which gradients accumulate across microbatches and are exposed as ``.grad``. None:
    the compute dtype. fp32 costs shard-sized memory and keeps small updates from rounding away."""
    grad_comm_dtype: Optional[torch.dtype] = None
    """Dtype of the gradient reduction on the wire. None: ``main_grads_dtype``. bf16 halves the
    traffic; fp32 sums exactly across many ranks."""

    def __post_init__(self) -> None:
        _check(self.main_params_dtype, "main_params_dtype")
        _check(self.main_grads_dtype, "main_grads_dtype")
        _check(self.grad_comm_dtype, "grad_comm_dtype")

    def resolve(self, compute_dtype: torch.dtype, trainable: bool = True) -> "ResolvedDtypes":
        """Concrete dtypes for a parameter group whose compute dtype is ``compute_dtype``. A frozen
        group (``trainable`` False: LoRA's base) is never stepped, so its main weights are its
        compute weights: no fp32 copy of weights that cannot change."""
        if compute_dtype not in _SUPPORTED:
            raise NotImplementedError(f"parameters of dtype {compute_dtype} are not supported; mfsdp computes in "
                                      "float32 or bfloat16 (cast the module with .to(torch.bfloat16) or .float())")
        main = (self.main_params_dtype if trainable else None) or compute_dtype
        grads = self.main_grads_dtype or compute_dtype
        comm = self.grad_comm_dtype or grads
        return ResolvedDtypes(compute=compute_dtype, main=main, grads=grads, comm=comm)


@dataclasses.dataclass(frozen=True)
class ResolvedDtypes:
    compute: torch.dtype
    main: torch.dtype
    grads: torch.dtype
    comm: torch.dtype

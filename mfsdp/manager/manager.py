"""``MegatronFSDPManager``: shard a Hugging Face style model over the manager mesh with mfsdp.

``parallelize(model, optimizer)`` walks one path at every world size:

1. check the config against the mesh and refuse, with the reason, what mfsdp cannot do yet;
2. tensor parallel (plan chosen and validated, applied over ``mesh["tp"]``);
3. activation checkpointing around each unit module's forward;
4. ``fully_shard`` each unit module bottom-up, then the root, with the config's ``placements`` (or
   those ``zero_dp_strategy`` stands for), the precision policy the fp32 flags map to and the
   communication policy the overlap / bucketing / loss-scaling flags map to; a model built on the
   meta device is then initialised shard-locally or loaded from a Hugging Face directory, slice by
   slice;
5. dress the root: ``dtype`` reports the compute dtype, ``finish_grad_sync`` /
   ``install_optimized_model_weights`` / ``zero_grad_buffer`` for optimizer-less loops, a guard
   against parameters replaced after wrapping, and a ``load_state_dict`` that accepts full
   (unsharded) tensors;
6. bind the optimizer, if one is given, with the core's ``fully_shard_optimizer``, keeping its param
   groups and settings.

The end of a step (gradient scaling, the NaN/Inf check) has one path, the core's, whichever way
the optimizer was built: the config only chooses the core options (``core_options``).

Everything goes through mfsdp's public API; the manager keeps its per-model state in one object
on the root module, never on Parameters.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import mfsdp
from mfsdp import FsdpModule, _compat
from mfsdp.hf.files import has_weights
from mfsdp.hf import sharded as hf_sharded
from mfsdp.manager.config import MegatronFSDPConfig, field_names
from mfsdp.manager.context_parallel import CAUSAL_SDPA, DP_SHARD_CP, use_causal_sdpa
from mfsdp.manager.core_options import (checkpoint_forward, communication_policy, dp_placements,
                                        mesh_placements, precision_policy, resolve_unit_modules)
from mfsdp.experts.parallel import expert_mesh
from mfsdp.manager.experts import check_ep_against_mesh, split_experts_over_ep
from mfsdp.manager.mesh import check_config_against_mesh, mesh_sizes
from mfsdp.manager.tp_plans import apply_tensor_parallel, loss_context, sequence_length_check

logger = logging.getLogger("mfsdp.manager")


NonFiniteGradientError = FloatingPointError
"""What the NaN/Inf check raises on every rank (``check_for_nan_in_grad``): the core's error, raised
at the end of backward by ``CommunicationPolicy(check_finite_gradients=True)``. Megatron-FSDP's
name, kept for ``except`` clauses."""


class _ManagerState:
    def __init__(self, config: MegatronFSDPConfig, compute_dtype: torch.dtype, groups, slots) -> None:
        self.config = config
        self.compute_dtype = compute_dtype
        self.groups = groups  # the trainable core parameter groups
        self.slots = slots  # [(module, attr, param, dtype)] as left by parallelize
        # The checked attributes as (the module's parameter dict, attr, param, dtype): a dict lookup
        # per parameter on every forward instead of nn.Module.__getattr__.
        self.guarded = [(module, module._parameters, attr, param, dtype) for module, attr, param, dtype in slots]
        self.aux_loss: Optional[torch.Tensor] = None  # the latest forward's load-balancing loss, where asked for


class MegatronFSDPModel:
    """Mixed into the root's class by :meth:`MegatronFSDPManager.parallelize`.

    Without an optimizer passed to ``parallelize``, a training step is::

        loss.backward(); model.finish_grad_sync(); optimizer.step()
        model.install_optimized_model_weights(); optimizer.zero_grad(); model.zero_grad_buffer()

    With an optimizer bound by ``fully_shard_optimizer`` (or passed to ``parallelize``) the plain
    ``loss.backward(); optimizer.step(); optimizer.zero_grad()`` does the same.
    """

    _mfsdp_manager_state: _ManagerState

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the parameters themselves are the main weights, fp32 by default)."""
        return self._mfsdp_manager_state.compute_dtype

    def finish_grad_sync(self) -> None:
        """Megatron-FSDP's end-of-step call, kept for its loops; there is nothing left to do here.

        The core finishes every step's gradients at the end of backward, whatever the loop: the
        reductions with their scaling (mean over dp, or the sum for ``calculate_per_token_loss``:
        ``CommunicationPolicy.gradient_divide_factor``) and the NaN/Inf check
        (``check_for_nan_in_grad``: ``CommunicationPolicy.check_finite_gradients``, which raises
        :data:`NonFiniteGradientError` from ``loss.backward()`` on every rank).
        """

    def install_optimized_model_weights(self) -> None:
        """Re-derive the compute weights from the main weights the optimizer just updated (the
        trainable groups: an optimizer changes nothing else)."""
        for group in self._mfsdp_manager_state.groups:
            group.refresh_if_stale()

    def loss_context(self):
        """The context the loss (forward and backward) runs in: torch's ``loss_parallel()`` with
        ``MegatronFSDPConfig.loss_parallel`` (vocabulary-sharded logits), else a null context; so a
        loop can always write ``with model.loss_context(): model(...).loss.backward()``."""
        return loss_context(self._mfsdp_manager_state.config.loss_parallel)

    @property
    def aux_loss_coef(self) -> Optional[float]:
        """The weight of the load-balancing loss of a mixture of experts whose config asks for it
        (``output_router_logits`` and ``router_aux_loss_coef`` > 0), as transformers' own forward
        with labels adds it; None otherwise. ``mfsdp train`` adds ``aux_loss_coef * aux_loss()``."""
        return router_aux_loss_coef(self)

    def aux_loss(self) -> torch.Tensor:
        """The unweighted load-balancing loss of the latest forward (transformers' ``aux_loss`` output,
        its ``load_balancing_loss_func`` over this rank's tokens); read it before the backward."""
        aux = self._mfsdp_manager_state.aux_loss
        if aux is None:
            raise RuntimeError("aux_loss() is only defined after a forward of a model whose config has "
                               "output_router_logits=True and router_aux_loss_coef > 0")
        return aux

    def zero_grad_buffer(self) -> None:
        """Drop the gradients (the next backward starts from zero)."""
        for p in self.parameters():
            p.grad = None

    def _apply(self, fn, recurse=True):
        """``to`` / ``float`` / ``cuda`` ...: a no-op for the parameters is fine, a change raises.

        A dtype or device change would detach the parameters from mfsdp's flat buffers, so ``fn`` is
        probed on empty tensors of the main-weight and compute dtypes before anything is touched.
        When it changes neither, it is applied to the buffers only (parameters stay as they are).
        """
        state = self._mfsdp_manager_state
        probes = {(dtype, param.device) for _, _, param, dtype in state.slots}
        probes |= {(state.compute_dtype, device) for _, device in probes}
        for dtype, device in probes:
            out = fn(torch.empty(0, dtype=dtype, device=device))
            if out.dtype != dtype or out.device != device:
                raise RuntimeError(
                    f"cannot convert an mfsdp-sharded model to {out.dtype} on {out.device} after parallelize: its "
                    f"{dtype} weights on {device} live in mfsdp's sharded buffers. Cast or move the model before "
                    "parallelize (the compute dtype is the dtype it had then; the main-weight dtype is "
                    "MegatronFSDPConfig.preserve_fp32_weights).")
        for module in self.modules() if recurse else (self,):
            for name, buf in list(module.named_buffers(recurse=False)):
                setattr(module, name, fn(buf))
        return self


def _make_guard(state: _ManagerState):
    def guard(module, args, kwargs):
        for owner, params, attr, param, dtype in state.guarded:
            current = params.get(attr)
            if current is not param or current.dtype != dtype:
                raise RuntimeError(
                    f"parameter {type(owner).__name__}.{attr} was replaced after parallelize (a re-tie, "
                    "load_state_dict(assign=True), or a dtype/device change?); mfsdp trains the parameters it "
                    "sharded. Tie weights and cast before parallelize; load with load_state_dict(assign=False).")
        return None

    return guard


def _make_load_hook(slots):
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for attr, param in slots:
            key = prefix + attr
            value = state_dict.get(key)
            if value is None or isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
                continue
            if tuple(value.shape) != tuple(param.shape):
                continue  # let load_state_dict report the size mismatch
            # Each rank keeps its own torch.chunk block of the full tensor: no communication.
            state_dict[key] = distribute_tensor(value.detach().to(param.device, param.dtype), param.device_mesh,
                                                param.placements, src_data_rank=None)

    return hook


_MANAGED_CLASSES: dict[type, type] = {}


def _dress_root(model: nn.Module, state: _ManagerState) -> None:
    cls = type(model)
    if cls not in _MANAGED_CLASSES:
        _MANAGED_CLASSES[cls] = type(f"Managed{cls.__name__}", (MegatronFSDPModel, cls), {"__module__": cls.__module__})
    model.__class__ = _MANAGED_CLASSES[cls]
    model._mfsdp_manager_state = state
    model.register_forward_pre_hook(_make_guard(state), prepend=True, with_kwargs=True)
    model.register_forward_hook(lambda module, args, out: setattr(state, "aux_loss", getattr(out, "aux_loss", None)))
    by_module: dict[int, tuple[nn.Module, list]] = {}
    for owner, attr, param, _ in state.slots:
        by_module.setdefault(id(owner), (owner, []))[1].append((attr, param))
    for owner, slots in by_module.values():
        owner.register_load_state_dict_pre_hook(_make_load_hook(slots))


# ---------------------------------------------------------------------------------- optimizer
def fully_shard_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                          preproc_state_dict_for_dcp_ckpt: bool = True) -> torch.optim.Optimizer:
    """Megatron-FSDP's name for :func:`mfsdp.fully_shard_optimizer` (the same binding); returns it.

    ``preproc_state_dict_for_dcp_ckpt`` is accepted for compatibility and has nothing to do: mfsdp's
    shards are ``torch.chunk`` blocks, i.e. ordinary evenly-described DTensors that DCP saves and
    loads as they are, so no uneven-shard metadata needs pre-processing.
    """
    return mfsdp.fully_shard_optimizer(model, optimizer)


def maybe_shard_optimizer(model_part: nn.Module, optimizer: torch.optim.Optimizer, distributed_config,
                          allow: bool = True) -> torch.optim.Optimizer:
    """Bind ``optimizer`` when ``distributed_config`` is a MegatronFSDPConfig in a job of world size > 1.

    Otherwise returns it unchanged. ``allow=False`` (an optimizer that cannot step on shards)
    raises exactly when binding would otherwise happen.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if not isinstance(distributed_config, MegatronFSDPConfig) or world <= 1:
        return optimizer
    if not allow:
        raise ValueError(
            f"{type(optimizer).__name__} cannot be used with mfsdp sharding (allow=False), but the strategy is "
            f"MegatronFSDPConfig on {world} ranks; use an elementwise optimizer (SGD, Adam, AdamW) or another "
            "strategy")
    return fully_shard_optimizer(model_part, optimizer)


def _rebind_optimizer(optimizer: torch.optim.Optimizer, old_names: dict[int, str], model: nn.Module) -> None:
    """Point an optimizer built before parallelize at the sharded main weights, group by group."""
    new = dict(model.named_parameters())
    sharded = {id(p) for p in new.values()}
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError("the optimizer passed to parallelize already has state (it has stepped); build it "
                         "fresh, or build it after parallelize on model.parameters()")
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if id(p) in sharded:
                params.append(p)
            elif id(p) in old_names and old_names[id(p)] in new:
                params.append(new[old_names[id(p)]])
            else:
                raise ValueError("the optimizer holds a parameter that is not a parameter of the model given to "
                                 "parallelize")
        group["params"] = params
    optimizer.state.clear()


# ------------------------------------------------------------------------------------ manager
class MegatronFSDPManager:
    """Parallelize models with mfsdp over a ``(dp_replicate, dp_shard, cp, tp)`` device mesh.

    Each config field is also an attribute of the manager, of the same name.
    """

    def __init__(self, config: MegatronFSDPConfig, device_mesh) -> None:
        if not isinstance(config, MegatronFSDPConfig):
            raise TypeError(f"config must be a MegatronFSDPConfig, got {type(config).__name__}")
        self.config = config
        self.device_mesh = device_mesh
        self.sizes = mesh_sizes(device_mesh)
        check_config_against_mesh(config, self.sizes)
        for name in field_names():
            setattr(self, name, getattr(config, name))
        self._check_supported()
        # The placements this mesh runs: config.placements, else what the Megatron integers stand for.
        self.placements = (mesh_placements(config.placements, self.sizes) if config.placements is not None else
                           dp_placements(config.zero_dp_strategy, self.sizes, config.outer_dp_sharding_strategy))
        check_ep_against_mesh(config.ep_size, self.sizes)
        # The experts' mesh, ([dp_replicate,] ep_shard, ep) over the same ranks; None without expert parallelism.
        self.expert_mesh = expert_mesh(self._dp_mesh(), config.ep_size) if config.ep_size > 1 else None

    def _check_supported(self) -> None:
        c, device = self.config, self.device_mesh.device_type
        if c.keep_fp8_transpose_cache:
            raise NotImplementedError(
                "MegatronFSDPConfig.keep_fp8_transpose_cache=True: mfsdp's FP8 is torchao's float8 linears "
                "(mfsdp.float8), which keep no Transformer Engine transpose cache; the weights are re-gathered "
                "for backward, in FP8 with mfsdp.float8.enable_fp8_all_gather (half the bf16 bytes). Leave it "
                "False")
        if c.nccl_ub:
            if device != "cuda":
                raise ValueError(f"MegatronFSDPConfig.nccl_ub=True needs CUDA (NCCL user buffers); this mesh is on "
                                 f"{device!r}")
            if not c.fsdp_double_buffer:
                raise ValueError("MegatronFSDPConfig.nccl_ub=True registers the persistent gather buffers with NCCL; "
                                 "set fsdp_double_buffer=True as well")
        if c.overlap_grad_reduce != c.overlap_param_gather:
            logger.warning("MegatronFSDPConfig: overlap_grad_reduce=%s, overlap_param_gather=%s: the core has one "
                           "overlap switch, so all communication is synchronous", c.overlap_grad_reduce,
                           c.overlap_param_gather)
        for name in ("sequence_parallel", "loss_parallel"):
            if getattr(c, name) and self.sizes.tp == 1:
                raise ValueError(f"MegatronFSDPConfig.{name}=True needs a mesh with tp > 1")
        if c.sequence_parallel and self.sizes.cp > 1:
            raise NotImplementedError("MegatronFSDPConfig.sequence_parallel=True with cp > 1: sequence-parallel "
                                      "activations inside context-parallel attention are not supported; use one")

    def _dp_mesh(self):
        """The sub-mesh ``fully_shard`` gets: the data-parallel dims (dp_shard x cp flattened), plus tp."""
        mesh = self.device_mesh
        if self.sizes.cp > 1:
            _compat.flatten_mesh(mesh["dp_shard", "cp"], DP_SHARD_CP)
        axes = tuple(self.placements.dp_axes) + (("tp",) if self.sizes.tp > 1 else ())
        return mesh[axes] if len(axes) > 1 else mesh[axes[0]]

    def loss_context(self):
        """Same as the parallelized model's ``loss_context()``: ``loss_parallel()`` or a null context."""
        return loss_context(self.config.loss_parallel)

    @property
    def communication_policy(self) -> mfsdp.CommunicationPolicy:
        return communication_policy(self.config, self.sizes)

    # ------------------------------------------------------------------------------ parallelize
    def parallelize(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    hf_path: Optional[str] = None, init_seed: int = 0):
        """Shard ``model`` in place; returns ``(model, optimizer)``.

        ``optimizer`` may be built on the model before this call (it is re-pointed at the sharded
        main weights, keeping its param groups and settings) or be None; then build one on
        ``model.parameters()`` afterwards and either bind it with :func:`fully_shard_optimizer` or
        drive the loop with ``install_optimized_model_weights`` / ``zero_grad_buffer``. Either way the
        NaN/Inf check and the gradient scaling run in the core, at the end of backward.

        A model built on the meta device (``init_fsdp_with_meta_device=True``) gets storage for this
        rank's shards only; then ``hf_path`` (a local HF safetensors directory) is loaded into the
        shards, each rank reading only its slices, or, without ``hf_path``, every shard is
        initialised locally (:func:`~mfsdp.hf.sharded.init_weights_shard_local`, seeded
        by ``init_seed``). ``hf_path`` also loads into a materialised model.
        """
        compute_dtype, on_meta = self._check_model(model, optimizer, hf_path)
        old_names = {id(p): n for n, p in model.named_parameters()}
        c, sizes = self.config, self.sizes

        if sizes.tp > 1:  # cp > 1: torch's context-parallel attention expects the DTensor path
            path = apply_tensor_parallel(model, self.device_mesh["tp"], user_plan=c.tp_plan,
                                         sequence_parallel=c.sequence_parallel, loss_parallel=c.loss_parallel,
                                         activation_path=c.tp_activation_path if sizes.cp == 1 else "dtensor")
            logger.info("tensor parallel over tp=%d: %s activations", sizes.tp, path)
            if c.sequence_parallel:
                model.register_forward_pre_hook(sequence_length_check(sizes.tp), prepend=True, with_kwargs=True)

        units = resolve_unit_modules(model, c.megatron_fsdp_unit_modules)
        if c.activation_checkpointing:
            for _, unit in units:
                checkpoint_forward(unit)
            hf_config = getattr(model, "config", None)
            if getattr(hf_config, "use_cache", False):
                logger.info("activation checkpointing: setting model.config.use_cache=False")
                hf_config.use_cache = False

        # The core takes the data-parallel axes, plus tp where the parameters are TP DTensors over it.
        dp_mesh, policy, comm = self._dp_mesh(), precision_policy(c), self.communication_policy
        if self.expert_mesh is not None:  # the experts become their own units, inside the layers' units
            split_experts_over_ep(model, self.expert_mesh, dp_mesh, self.placements, c.ep_size,
                                  mixed_precision=policy, communication=comm)
        for module in [unit for _, unit in units] + [model]:
            mfsdp.fully_shard(module, dp_mesh, self.placements, policy, c.nccl_ub, communication_policy=comm)
        if sizes.cp > 1 and hasattr(model, "set_attn_implementation"):
            logger.info("context parallel: switching attention to %s (causal SDPA without a mask tensor)",
                        CAUSAL_SDPA)
            use_causal_sdpa(model)
        if on_meta:
            hf_sharded.materialize_meta_buffers(model)
        if hf_path is not None:
            hf_sharded.load_hf_weights(model, hf_path)
        elif on_meta:
            hf_sharded.init_weights_shard_local(model, seed=init_seed)

        _dress_root(model, _ManagerState(c, compute_dtype, _gradient_groups(model), _slots(model)))
        if optimizer is not None:
            _rebind_optimizer(optimizer, old_names, model)
            fully_shard_optimizer(model, optimizer)
        logger.info("mfsdp: %s over mesh %s, %d unit modules, %s, %s", self.placements.name, sizes, len(units),
                    policy, comm)
        return model, optimizer

    def _check_model(self, model: nn.Module, optimizer, hf_path: Optional[str]) -> tuple[torch.dtype, bool]:
        """Refuse what ``parallelize`` cannot shard; the model's compute dtype and whether it is on meta."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"parallelize expects an nn.Module, got {type(model).__name__}")
        if isinstance(model, FsdpModule) or any(isinstance(m, FsdpModule) for m in model.modules()):
            raise ValueError("this model is already sharded by mfsdp; parallelize it once")
        floating = [p for p in model.parameters() if p.is_floating_point()]
        if not floating:
            raise ValueError(f"{type(model).__name__} has no floating-point parameters to shard")
        on_meta = any(p.is_meta for p in model.parameters())
        if on_meta and not self.config.init_fsdp_with_meta_device:
            raise ValueError(f"{type(model).__name__} has parameters on the meta device; set "
                             "MegatronFSDPConfig.init_fsdp_with_meta_device=True to shard and initialise it here")
        if on_meta and optimizer is not None:
            raise ValueError("an optimizer cannot be built on a meta-device model; pass optimizer=None and build "
                             "it on model.parameters() after parallelize")
        if hf_path is not None and not has_weights(hf_path):
            raise FileNotFoundError(f"hf_path={hf_path!r} holds no model.safetensors (or index)")
        dtypes = {p.dtype for p in floating}
        if len(dtypes) > 1:
            logger.warning("model parameters have several dtypes %s; model.dtype reports %s", dtypes, floating[0].dtype)
        return floating[0].dtype, on_meta

    def load_pretrained(self, model: nn.Module, path: str) -> nn.Module:
        """Load a local HF safetensors directory into a model this manager parallelized (slices only)."""
        hf_sharded.load_hf_weights(model, path)
        return model

    def save_pretrained(self, model: nn.Module, path: str, **kwargs) -> None:
        """Export consolidated HF safetensors + config.json (a collective; rank 0 writes)."""
        hf_sharded.save_hf_checkpoint(model, path, **kwargs)


def router_aux_loss_coef(model: nn.Module) -> Optional[float]:
    """``config.router_aux_loss_coef`` of a model whose config asks for the load-balancing loss
    (``output_router_logits``, coefficient > 0); None otherwise."""
    config = getattr(model, "config", None)
    coef = getattr(config, "router_aux_loss_coef", None)
    return float(coef) if getattr(config, "output_router_logits", False) and coef and coef > 0 else None


def _gradient_groups(model: nn.Module) -> list:
    """The trainable core parameter groups of every unit under ``model``."""
    return [group for module in model.modules() if isinstance(module, FsdpModule)
            for group in module.parameter_groups if group.requires_grad]


def _slots(model: nn.Module) -> list:
    out = []
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            out.append((module, attr, param, param.dtype))
    return out


"""Apply mfsdp to a Llama model: activation checkpointing, then one shard unit per block,
then the root.

The model file knows nothing about parallelism; this file is the one place that decides
how it is cut. Each block is its own unit, so only one block's full weights exist at a
time (plus the prefetched next one). The embedding and the output head are units of their
own (``sharding_units``), so the root keeps just the final norm; the embedding, whose
backward never reads its table, is then not gathered in backward at all.

Mixture-of-experts blocks (``mfsdp.models.moe``) are cut the same way by default. With
``expert_units=True`` each block's experts module (its stacked experts, ``GroupedExperts``) becomes
a unit of its own inside its block's unit: the experts' weights are then gathered, and their
gradients reduced, apart from the rest of the block.

With ``compile`` each block is compiled after sharding (the hooks stay outside its graphs).

``transforms`` (``mfsdp.transforms``: float8 training, ``mfsdp.transforms.float8``) rewrite the
unsharded model before anything else, in list order; the memory planner replays the same list.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

import mfsdp
from mfsdp.experts.parallel import apply_expert_parallel, ep_problem
from mfsdp.mesh import PLACEMENT_NAMES, resolve_placements
from mfsdp.models.llama import Llama
from mfsdp.models.moe import MoEFeedForward
from mfsdp.transforms import apply_transforms, validate_order



@dataclass(frozen=True)
class ParallelizeConfig:
    """How ``parallelize`` shards a model."""

    placements: "str | mfsdp.Placements" = "zero3"
    """A name (zero3, zero2, zero1, ddp, hsdp, hfsdp) or a Placements object."""
    mixed_precision: "mfsdp.MixedPrecisionPolicy | None" = None
    """Main-weight and gradient dtypes; None keeps the core's default policy."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them."""
    expert_units: bool = False
    """Shard the experts module of each mixture-of-experts block (all its stacked experts) as its own
    unit inside the block's unit, instead of with the rest of the block; needs a model with experts."""
    transforms: tuple = ()
    """Model transforms (``mfsdp.transforms.ModelTransform``) applied to the unsharded model first, in
    order: ``(Float8Transform("tensorwise"),)`` trains the linears in float8 with FP8 all-gather."""
    communication: "mfsdp.CommunicationPolicy | None" = None
    """How every unit's collectives are scheduled (streams, prefetch); None keeps the core's default."""
    keep_gathered_blocks: int = 0
    """How many blocks, the last ones (``kept_blocks``), keep their gathered weights through the step
    (``CommunicationPolicy.keep_gathered``): one gather per step instead of two per microbatch, for
    their compute-dtype (FP8: float8) weights resident throughout."""
    ep: int = 1
    """Expert parallelism: split each mixture-of-experts layer's experts over ``ep`` ranks of the mesh's
    shard dim, each expert FSDP-sharded over the ranks that remain (``mfsdp.experts.parallel``); tokens
    reach their experts by all-to-all. 1: every rank holds (a shard of) every expert."""
    compile: bool = False
    """torch.compile each block (``nn.Module.compile``, inductor). The sharding hooks stay outside
    the graphs (they are ``torch.compiler.disable``d), so each block compiles to one graph per
    direction and the gathers and reductions run between them, as in the benchmarks."""

    def __post_init__(self) -> None:
        if isinstance(self.placements, str) and self.placements not in PLACEMENT_NAMES:
            raise ValueError(f"unknown placements {self.placements!r}; use zero3, zero2, "
                             "zero1, ddp, hsdp or hfsdp, or pass a mfsdp.Placements")
        if not isinstance(self.keep_gathered_blocks, int) or self.keep_gathered_blocks < 0:
            raise ValueError(f"keep_gathered_blocks must be an int >= 0, got {self.keep_gathered_blocks!r}")
        if not isinstance(self.transforms, tuple):
            raise ValueError(f"transforms must be a tuple of model transforms, got {self.transforms!r}")
        validate_order(self.transforms)
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep must be a positive int, got {self.ep!r}")


def parallelize(model: Llama, mesh: DeviceMesh, config: ParallelizeConfig) -> Llama:
    """Shard ``model`` in place over ``mesh`` and return it.

    The model arrives either with its weights initialised in its compute dtype (every rank
    must hold the same values, since each keeps only its own shard), or built on the meta
    device: each rank then allocates only its shards, and ``model.to_empty(device=...)``
    followed by ``model.init_weights(seed=...)`` materialises the buffers and fills the
    shards with the values an unsharded init would give (``mfsdp train`` does this).
    """
    placements = resolve_placements(config.placements)
    if config.expert_units and not any(isinstance(b.feed_forward, MoEFeedForward) for b in model.layers):
        raise ValueError("ParallelizeConfig.expert_units=True needs a model with experts "
                         "(LlamaConfig.num_experts > 0, built by mfsdp.models.build_model); "
                         "set expert_units=False for a dense model")
    apply_transforms(model, config.transforms)
    if config.activation_checkpointing:
        model.set_activation_checkpointing(True)
    if config.ep > 1:  # the experts first: units of their own on the experts' mesh, inside their blocks
        problem = ep_problem(config.ep, mesh.size(mesh.ndim - 1), model.cfg.num_experts)
        if problem:
            raise ValueError(problem)
        apply_expert_parallel(model, mesh, placements, config.ep, mixed_precision=config.mixed_precision,
                              communication=config.communication)
    # Bottom-up: each unit before the root claims the rest (the final norm).
    kept = {id(b) for b in kept_blocks(list(model.layers), config.keep_gathered_blocks)}
    keeping = dataclasses.replace(config.communication or mfsdp.CommunicationPolicy(), keep_gathered=True)
    for unit in sharding_units(model, expert_units=config.expert_units and config.ep == 1):
        mfsdp.fully_shard(unit, mesh, placements, mixed_precision_policy=config.mixed_precision,
                          communication_policy=keeping if id(unit) in kept else config.communication)
    mfsdp.fully_shard(model, mesh, placements, mixed_precision_policy=config.mixed_precision,
                      communication_policy=config.communication)
    if config.compile:
        compile_modules(model.layers)
    return model


def compile_modules(modules) -> None:
    """torch.compile each of ``modules`` in place (lazily: the first call compiles). One rule for
    the bundled models and the Hugging Face ones: the unit modules, the blocks, are what compiles."""
    for module in modules:
        module.compile()


def kept_blocks(blocks: list, count: int) -> list:
    """The blocks that keep their gathered weights through the step (``keep_gathered_blocks``): the
    last ``count``, whose backward follows their forward soonest. The one rule, which ``mfsdp.memory``
    plans with too (over block names)."""
    if not 0 <= count <= len(blocks):
        raise ValueError(f"keep_gathered_blocks={count}, but the model has {len(blocks)} blocks; give a number "
                         f"from 0 to {len(blocks)}")
    return blocks[len(blocks) - count:]


def sharding_units(model: Llama, expert_units: bool = False) -> list:
    """The modules sharded as units, bottom-up: the embedding, every block, and the output head;
    with ``expert_units``, the experts module of each mixture-of-experts block comes just before its block.

    Giving the two vocabulary-sized matrices their own units lets the head's gradient reduction
    overlap the last blocks' backward and keeps the root (then just the final norm) tiny; with a
    tied embedding the pair must stay in one unit, so the root keeps both.
    """
    units = []
    for block in model.layers:
        if expert_units and isinstance(block.feed_forward, MoEFeedForward):
            units.append(block.feed_forward.experts)
        units.append(block)
    if model.output.weight is not model.tok_embeddings.weight:
        units = [model.tok_embeddings, *units, model.output]
    return units


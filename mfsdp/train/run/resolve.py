"""From what the user said to what the run is, in one place and once.

``resolve`` takes a ``RunConfig`` as parsed (``mfsdp.train.command.args``, which reads no model file) and
returns it with everything looked up and derived: the --model.hf directory's config.json and
weights, the route ("auto" to bundled or manager), the model's shape and parameter counts (its
transforms checked on the one meta model built here), the recipe's values of the unset ``--train``
fields. The config holds them in ``cfg.resolved``; the preflight checks, the planner, the reports and
the build read them there, so nothing reads the directory, builds a meta model or counts again.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import torch

from mfsdp.experts.parallel import ep_problem
from mfsdp.hf.config import UnsupportedHFConfig, bundled_config_from_hf
from mfsdp.models import flops
from mfsdp.models.llama import LlamaConfig
from mfsdp.models.parallelize import kept_blocks
from mfsdp.hf.files import has_weights
from mfsdp.train.run import determinism
from mfsdp.train.command.args import parse_config
from mfsdp.train.run.config import FROM_RECIPE, ModelSection, ResolvedModel, RunConfig
from mfsdp.train.command.errors import ConfigError, require


def load_config(argv: list[str]) -> RunConfig:
    """``argv`` (without the program name) parsed (``mfsdp.train.command.args``) and resolved."""
    return resolve(parse_config(argv))


def resolve(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its --model.hf directory read, its route, model and recipe resolved, and checked
    against the environment and the model; raises ConfigError naming the fix."""
    if cfg.parallel.deterministic and (problem := determinism.environment_problem()):
        raise ConfigError(problem)
    for package, extra in (("tensorboard", "train"), ("wandb", "wandb")):
        require(not getattr(cfg.metrics, package) or importlib.util.find_spec(package) is not None,
                f"--metrics.{package} true needs the {package} package; pip install {package} (or mfsdp[{extra}])")
    m, hf_config = cfg.model, None
    if m.hf is None:
        shape = m.llama_config(cfg.data.seq_len)
    else:
        path = Path(m.hf) / "config.json"
        require(path.is_file(), f"--model.hf {m.hf}: no config.json there (a local Hugging Face model directory "
                "is needed)")
        hf_config = json.loads(path.read_text())
        m, shape = _hf_model(m, hf_config, cfg.data.seq_len)
    cfg = dataclasses.replace(cfg, model=m)
    cfg = dataclasses.replace(cfg, resolved=_resolve_model(cfg, shape, hf_config))
    if cfg.train.out_dir is None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=cfg.model.default_out_dir()))
    return _fill_recipe(cfg)


def check_expert_parallel(cfg: RunConfig, world: int, tp: int = 1) -> None:
    """``--parallel.ep`` against the model and the ``world`` ranks (``tp`` of them tensor-parallel, in
    ``mfsdp plan --tp``): it must divide the data-parallel shard ranks and the experts per layer of a
    model that has experts, without tensor parallelism; raises ConfigError naming the fix. The one
    place it is checked: the launcher and every worker (``preflight.check_run``), and ``mfsdp plan``."""
    ep = cfg.parallel.ep
    if ep == 1:
        return
    require(tp == 1, f"--parallel.ep {ep} with tensor parallelism (--tp {tp}) is not supported; use --tp 1 or "
            "--parallel.ep 1")
    problem = ep_problem(ep, cfg.dp_shard(world // tp), cfg.resolved.num_experts)
    require(problem is None, problem)


def with_steps(cfg: RunConfig, steps: int) -> RunConfig:
    """``cfg`` for a run of ``steps`` steps (``--train.epochs``), the recipe's warm-up re-derived for
    them where no flag set it."""
    unset = {key: None for key in cfg.from_recipe}
    return _fill_recipe(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps, **unset)))


def with_pairs(cfg: RunConfig) -> RunConfig:
    """``cfg`` for a file of preference pairs: the DPO recipe's values where no flag set them."""
    return with_steps(dataclasses.replace(cfg, pairs=True), cfg.train.steps)


def _fill_recipe(cfg: RunConfig) -> RunConfig:
    """The one place the recipe's unset fields (None) become the recipe's values: every reader of
    cfg.train (the optimizer, the schedule, the checkpoint's meta.json) sees numbers."""
    unset = tuple(key for key in FROM_RECIPE if getattr(cfg.train, key) is None)
    values = cfg.recipe_values() if unset else {}
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **{key: values[key] for key in unset}),
                               from_recipe=unset)


def _hf_model(m: ModelSection, c: dict, seq_len: int) -> tuple[ModelSection, LlamaConfig]:
    """The --model.hf model's section, its route checked against its config.json ``c`` and "auto"
    resolved to the bundled route or the manager's, once (the checkpoint records it and a resume keeps
    it), and its shape: on the bundled route the exact config of the bundled Llama that runs it;
    through the manager its shape (for FLOP counts and checkpoint checks)."""
    if m.hf_impl != "manager":
        try:
            return dataclasses.replace(m, hf_impl="bundled"), bundled_config_from_hf(c, seq_len)
        except UnsupportedHFConfig as err:
            why = str(err)
        require(m.hf_impl == "auto", f"--model.hf_impl bundled: {m.hf} cannot run as the bundled Llama: {why} "
                "(--model.hf_impl manager or auto)")
        require(m.float8 == "none", f"--model.float8 needs the bundled Llama, which cannot run {m.hf} ({why}); "
                "use --model.float8 none")
        m = m.on_manager()
    try:
        return m, LlamaConfig.from_hf(c, seq_len)
    except (KeyError, ValueError) as err:
        raise ConfigError(f"--model.hf {m.hf}: config.json is not a decoder config mfsdp can train ({err})") from None


def _resolve_model(cfg: RunConfig, shape: LlamaConfig, hf_config: dict | None) -> ResolvedModel:
    """What the run needs to know of its model (``ResolvedModel``), each count found once, with the
    checks that its ``shape`` allows."""
    require(not cfg.parallel.expert_units or (cfg.model.hf is None and shape.num_experts > 0),
            "--parallel.expert_units true needs a built-in mixture-of-experts model "
            "(--model.preset moe-tiny or moe-1b, or --model.num_experts N); unset it otherwise")
    if kept := cfg.parallel.kept_blocks():
        require(not cfg.model.uses_manager, f"--parallel.keep_gathered_blocks applies to the bundled Llama; "
                f"{cfg.model.hf} trains through the manager here. Use --parallel.keep_gathered_blocks 0")
        try:
            kept_blocks(range(shape.n_layers), kept)
        except ValueError as err:  # the rule's own words, for the flag
            raise ConfigError(f"--parallel.{err}") from None
    found = ResolvedModel(shape, flops.param_counts(shape)["total"], 0, hf_config,
                          cfg.model.hf is not None and has_weights(cfg.model.hf))
    return dataclasses.replace(found, adapter_params=_adapter_params(cfg, found))


def _adapter_params(cfg: RunConfig, found: ResolvedModel) -> int:
    """LoRA's adapter parameters (0 without), counted on the one meta model of the run: the model
    transforms of ``cfg`` (``build.transforms_for``: --model.float8, --peft) are applied, by their own
    rules, to the model that trains built on the meta device (the bundled Llama of its shape, or the
    Hugging Face model of its config.json on the manager route), and a ValueError
    becomes the ConfigError of the flags."""
    from mfsdp.train.build.model import transforms_for
    from mfsdp.transforms import apply_transforms

    if not (model_transforms := transforms_for(cfg)):
        return 0
    if cfg.model.uses_manager:
        from mfsdp.hf.sharded import meta_model_from_config

        model = meta_model_from_config(found.transformers_config)
    else:
        from mfsdp.models import build_model

        with torch.device("meta"):
            model = build_model(found.shape)
    try:
        apply_transforms(model, model_transforms)
    except ValueError as err:  # float8's words lack the flag; LoRA's name theirs
        message = str(err)
        if message.startswith("mfsdp.float8: "):
            flag = "--model.float8_skip" if cfg.model.float8_skip_patterns() else "--model.float8"
            message = f"{flag}: {message.removeprefix('mfsdp.float8: ')}"
        raise ConfigError(message) from None
    return sum(p.numel() for p in model.parameters() if p.requires_grad) if cfg.peft.lora else 0

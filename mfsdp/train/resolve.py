"""From what the user said to what the run is, in one place and once.

``resolve`` takes a ``RunConfig`` as parsed (``mfsdp.train.args``, which reads no model file) and
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

from mfsdp.models import flops
from mfsdp.models.hf_config import supports_bundled
from mfsdp.models.llama import LlamaConfig
from mfsdp.models.parallelize import kept_blocks
from mfsdp.hf_io import has_weights
from mfsdp.train import determinism
from mfsdp.train.args import parse_config
from mfsdp.train.config import FROM_RECIPE, ModelSection, ResolvedModel, RunConfig, bundled_refusal
from mfsdp.train.errors import ConfigError, require


def load_config(argv: list[str]) -> RunConfig:
    """``argv`` (without the program name) parsed (``mfsdp.train.args``) and resolved."""
    return resolve(parse_config(argv))


def resolve(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its --model.hf directory read, its route, model and recipe resolved, and checked
    against the environment and the model; raises ConfigError naming the fix."""
    if cfg.parallel.deterministic and (problem := determinism.environment_problem()):
        raise ConfigError(problem)
    require(not cfg.metrics.tensorboard or importlib.util.find_spec("tensorboard") is not None,
            "--metrics.tensorboard true needs the tensorboard package; pip install tensorboard (or mfsdp[train])")
    require(not cfg.metrics.wandb or importlib.util.find_spec("wandb") is not None,
            "--metrics.wandb true needs the wandb package; pip install wandb (or mfsdp[wandb])")
    hf_config = None
    if cfg.model.hf is not None:
        path = Path(cfg.model.hf) / "config.json"
        require(path.is_file(), f"--model.hf {cfg.model.hf}: no config.json there (a local Hugging Face model "
                "directory is needed)")
        hf_config = json.loads(path.read_text())
        cfg = dataclasses.replace(cfg, model=_route(cfg.model, hf_config, cfg.data.seq_len))
    cfg = dataclasses.replace(cfg, resolved=_resolve_model(cfg, hf_config))
    if cfg.train.out_dir is None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=cfg.model.default_out_dir()))
    return _fill_recipe(cfg)


def with_steps(cfg: RunConfig, steps: int) -> RunConfig:
    """``cfg`` for a run of ``steps`` steps (``--train.epochs``), the recipe's warm-up re-derived for
    them where no flag set it."""
    unset = {key: None for key in cfg.from_recipe}
    return _fill_recipe(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps, **unset)))


def _fill_recipe(cfg: RunConfig) -> RunConfig:
    """The one place the recipe's unset fields (None) become the recipe's values: every reader of
    cfg.train (the optimizer, the schedule, the checkpoint's meta.json) sees numbers."""
    unset = tuple(key for key in FROM_RECIPE if getattr(cfg.train, key) is None)
    values = cfg.recipe_values() if unset else {}
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **{key: values[key] for key in unset}),
                               from_recipe=unset)


def _route(m: ModelSection, hf_config: dict, seq_len: int) -> ModelSection:
    """The --model.hf model's section with its route checked against its config.json and "auto"
    resolved to the bundled route or the manager's, once: the checkpoint records it and a resume
    keeps it."""
    if m.hf_impl == "manager":
        return m
    why = supports_bundled(hf_config, seq_len)
    require(why is None or m.hf_impl == "auto", bundled_refusal(m, why))
    require(why is None or m.float8 == "none", f"--model.float8 needs the bundled Llama, which cannot run "
            f"{m.hf} ({why}); use --model.float8 none")
    if m.hf_impl != "auto":
        return m
    return m.on_manager() if why else dataclasses.replace(m, hf_impl="bundled")


def _resolve_model(cfg: RunConfig, hf_config: dict | None) -> ResolvedModel:
    """The model's shape, parameter counts and (on the manager route) transformers config, each found
    once, with the checks they allow."""
    shape = cfg.model.llama_config(cfg.data.seq_len, hf_config)
    require(not cfg.parallel.expert_units or (cfg.model.hf is None and shape.num_experts > 0),
            "--parallel.expert_units true needs a built-in mixture-of-experts model "
            "(--model.preset moe-tiny or moe-1b, or --model.num_experts N); unset it otherwise")
    _check_kept_blocks(cfg, shape)
    hf = None
    if cfg.model.uses_manager:  # the one transformers config of the model every later step builds
        import transformers

        hf = transformers.AutoConfig.for_model(**hf_config)
    return ResolvedModel(shape, flops.param_counts(shape)["total"], _adapter_params(cfg, shape, hf), hf_config,
                         cfg.model.hf is not None and has_weights(cfg.model.hf), hf)


def _check_kept_blocks(cfg: RunConfig, shape: LlamaConfig) -> None:
    if not (kept := cfg.parallel.kept_blocks()):
        return
    require(not cfg.model.uses_manager, f"--parallel.keep_gathered_blocks applies to the bundled Llama; "
            f"{cfg.model.hf} trains through the manager here. Use --parallel.keep_gathered_blocks 0")
    try:
        kept_blocks(range(shape.n_layers), kept)
    except ValueError as err:  # the rule's own words, for the flag
        raise ConfigError(f"--parallel.{err}") from None


def _adapter_params(cfg: RunConfig, shape: LlamaConfig, hf) -> int:
    """LoRA's adapter parameters (0 without), counted on the one meta model of the run: the model
    transforms of ``cfg`` (``build.transforms_for``: --model.float8, --peft) are applied, by their own
    rules, to the model that trains built on the meta device (the bundled Llama of ``shape``, or the
    Hugging Face model of the transformers config ``hf`` on the manager route), and a ValueError
    becomes the ConfigError of the flags."""
    from mfsdp.train.build import transforms_for
    from mfsdp.transforms import apply_transforms

    if not (model_transforms := transforms_for(cfg)):
        return 0
    if hf is not None:
        from mfsdp.manager.hf_checkpoint import meta_model_from_config

        model = meta_model_from_config(hf)
    else:
        from mfsdp.models import build_model

        with torch.device("meta"):
            model = build_model(shape)
    try:
        apply_transforms(model, model_transforms)
    except ValueError as err:  # float8's words lack the flag; LoRA's name theirs
        message = str(err)
        if message.startswith("mfsdp.float8: "):
            flag = "--model.float8_skip" if cfg.model.float8_skip_patterns() else "--model.float8"
            message = f"{flag}: {message.removeprefix('mfsdp.float8: ')}"
        raise ConfigError(message) from None
    return sum(p.numel() for p in model.parameters() if p.requires_grad) if cfg.peft.lora else 0

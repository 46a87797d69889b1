"""From what the user said to what the run is: the part of preflight that the config's values need.

``resolve`` takes a ``RunConfig`` as parsed (``mfsdp.train.args``) and returns it with everything
looked up: the --model.hf directory's config.json and weights, the route ("auto" to bundled or
manager), the recipe's values of the unset ``--train`` fields. It also checks what needs more than
the values: the environment, the model's blocks and linears. The config objects only hold results.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import torch

from mfsdp.models.hf_config import supports_bundled
from mfsdp.models.parallelize import kept_blocks
from mfsdp.hf_io import has_weights
from mfsdp.train import determinism
from mfsdp.train.config import FROM_RECIPE, RunConfig, bundled_refusal
from mfsdp.train.errors import ConfigError, require


def resolve(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its --model.hf directory read, its route and recipe resolved, and checked against
    the environment and the model; raises ConfigError naming the fix."""
    if cfg.parallel.deterministic and (problem := determinism.environment_problem()):
        raise ConfigError(problem)
    require(not cfg.metrics.tensorboard or importlib.util.find_spec("tensorboard") is not None,
            "--metrics.tensorboard true needs the tensorboard package; pip install tensorboard (or mfsdp[train])")
    require(not cfg.metrics.wandb or importlib.util.find_spec("wandb") is not None,
            "--metrics.wandb true needs the wandb package; pip install wandb (or mfsdp[wandb])")
    if cfg.model.hf is not None:
        cfg = _resolve_hf(cfg)
    _check_kept_blocks(cfg)
    check_transforms(cfg)
    if cfg.train.out_dir is None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=cfg.model.default_out_dir()))
    return _fill_recipe(cfg)


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
    values = cfg.recipe_values() if unset else {}  # the recipe of a --model.hf model reads its shape
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **{key: values[key] for key in unset}),
                               from_recipe=unset)


def _resolve_hf(cfg: RunConfig) -> RunConfig:
    """Read the --model.hf directory (config.json, whether it holds weights), check the route against
    the config.json and resolve "auto" to the bundled route or the manager's, once: the checkpoint
    records it and a resume keeps it."""
    m, path = cfg.model, Path(cfg.model.hf) / "config.json"
    require(path.is_file(), f"--model.hf {m.hf}: no config.json there (a local Hugging Face model directory "
            "is needed)")
    cfg = dataclasses.replace(cfg, hf_config=json.loads(path.read_text()), hf_weights=has_weights(m.hf))
    if m.hf_impl == "manager":
        return cfg
    why = supports_bundled(cfg.hf_config, cfg.data.seq_len)
    require(why is None or m.hf_impl == "auto", bundled_refusal(m, why))
    require(why is None or m.float8 == "none", f"--model.float8 needs the bundled Llama, which cannot run "
            f"{m.hf} ({why}); use --model.float8 none")
    auto = m.on_manager() if why else dataclasses.replace(m, hf_impl="bundled")
    return dataclasses.replace(cfg, model=auto) if m.hf_impl == "auto" else cfg


def _check_kept_blocks(cfg: RunConfig) -> None:
    if not (kept := cfg.parallel.kept_blocks()):
        return
    require(not cfg.model.uses_manager, f"--parallel.keep_gathered_blocks applies to the bundled Llama; "
            f"{cfg.model.hf} trains through the manager here. Use --parallel.keep_gathered_blocks 0")
    try:
        kept_blocks(range(cfg.llama_config().n_layers), kept)
    except ValueError as err:  # the rule's own words, for the flag
        raise ConfigError(f"--parallel.{err}") from None


def check_transforms(cfg: RunConfig) -> None:
    """The model transforms of ``cfg`` (``build.transforms_for``: --model.float8, --peft) must fit its
    model: they are applied, by their own rules, to the model that trains built on the meta device
    (the bundled Llama, or the Hugging Face model of --model.hf's config.json on the manager route),
    and a ValueError becomes the ConfigError of the flags."""
    from mfsdp.train.build import transforms_for
    from mfsdp.transforms import apply_transforms

    if not (model_transforms := transforms_for(cfg)):
        return
    if cfg.model.uses_manager:
        from mfsdp.manager.hf_checkpoint import meta_model_from_config

        model = meta_model_from_config(cfg.model.hf)
    else:
        from mfsdp.models import build_model

        with torch.device("meta"):
            model = build_model(cfg.llama_config())
    try:
        apply_transforms(model, model_transforms)
    except ValueError as err:  # float8's words lack the flag; LoRA's name theirs
        message = str(err)
        if message.startswith("mfsdp.float8: "):
            flag = "--model.float8_skip" if cfg.model.float8_skip_patterns() else "--model.float8"
            message = f"{flag}: {message.removeprefix('mfsdp.float8: ')}"
        raise ConfigError(message) from None

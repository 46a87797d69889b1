"""A run is resolved once, in ``mfsdp.train.run.resolve``: its shape is computed once, its meta model built
once, its config.json read once, and everything after (the launcher's checks, the disk check, the
first line, the plan) reads ``cfg.resolved``."""

from __future__ import annotations

from pathlib import Path

import pytest

from mfsdp.models.llama import Llama
from mfsdp.train.run.config import ModelSection
from mfsdp.train.command.launcher import LaunchOptions, check

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _count(monkeypatch, owner, name: str) -> list:
    """Calls of ``owner.name`` from now on, each appended to the returned list."""
    calls, original = [], getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)
    return calls


def test_the_launcher_check_builds_one_meta_model_and_computes_the_shape_once(monkeypatch, tmp_path):
    """A LoRA run over float8 that exports: the transforms are checked, the adapters counted for the
    disk check (checkpoints and export) and the parameters for the first line, on one meta model."""
    shapes, builds = _count(monkeypatch, ModelSection, "llama_config"), _count(monkeypatch, Llama, "__init__")
    run = check(LaunchOptions(nproc_per_node=1), [
        "--model.float8", "tensorwise", "--peft.method", "lora", "--train.export_hf", "true",
        "--train.device", "cpu", "--train.out_dir", str(tmp_path)])
    assert (len(shapes), len(builds)) == (1, 1)
    # r 16 on the 7 linears of 4 blocks: wq, wo 256x256; wk, wv 256x128; w1, w2, w3 256x768
    assert run.cfg.resolved.adapter_params == 4 * 16 * (2 * 512 + 2 * 384 + 3 * 1024)
    assert run.cfg.resolved.params == 3_410_176  # the tiny preset: "3.4M parameters" in the first line


def test_the_manager_route_reads_config_json_once(monkeypatch, tmp_path):
    """--model.hf on the manager route: config.json is parsed once; the meta model (the LoRA check),
    the plan and the build take the parsed config, never the directory again."""
    transformers = pytest.importorskip("transformers")
    from mfsdp.hf import sharded as hf_checkpoint
    from mfsdp.hf.random_model import model_config
    from mfsdp.train.command.plan import main as plan_main

    hf = tmp_path / "hf"
    model_config("tiny").save_pretrained(hf)
    rereads = _count(monkeypatch, transformers.AutoConfig, "from_pretrained")
    reads, builds = _count(monkeypatch, Path, "read_text"), _count(monkeypatch, hf_checkpoint, "meta_model_from_config")
    argv = ["--model.hf", str(hf), "--model.hf_impl", "manager", "--peft.method", "lora", "--train.out_dir",
            str(tmp_path / "run"), "--train.device", "cpu"]
    run = check(LaunchOptions(nproc_per_node=1), argv)
    assert len(rereads) == 0 and len(builds) == 1
    assert [path for path, *_ in reads if path.name == "config.json"] == [hf / "config.json"]
    assert run.cfg.resolved.transformers_config.hidden_size == 64 and run.cfg.resolved.adapter_params == 32_768
    assert plan_main([*argv, "--out", str(tmp_path / "plan.png")]) == 0
    assert len(rereads) == 0

"""Runs that travel (issue 54): `mfsdp export` of a LoRA run from another directory, for a checkpoint
recording its base directory as typed (relative, before meta.json made it absolute) and one recording
it absolute; `--model.hf DIR` for a base that moved; an adapter export whose base is gone (written,
one line on the tokenizer, a load hint naming no missing directory) and a merged one (one error line)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from mfsdp.cli import main as cli
from mfsdp.hf.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled", "ignore::UserWarning", "ignore::FutureWarning")]
transformers = pytest.importorskip("transformers")


def lora_run(root, absolute: bool):
    """``root/base`` (a tiny Hugging Face Llama with a tokenizer's files) and a LoRA run on it in
    ``root/run`` (run.json and checkpoints/step_3), started in ``root`` with ``--model.hf base``; its
    meta.json records that path absolute (``absolute``) or as typed, as older checkpoints do."""
    from test_lora_save import LORA
    from test_manager_models import make_hf

    from mfsdp.hf.config import bundled_config_from_hf
    from mfsdp.models import Llama
    from mfsdp.train.build.adapters import adapter_record
    from mfsdp.train.run.resolve import load_config
    from mfsdp.train.checkpoint import CheckpointMeta, save_checkpoint
    from mfsdp.train.run.run_dir import absolute_paths, claim

    make_hf("llama", vocab=62).save_pretrained(root / "base")
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        (root / "base" / name).write_text("{}")
    model = Llama(bundled_config_from_hf(root / "base", 12))
    LORA.apply(model)
    here = os.getcwd()
    os.chdir(root)
    try:
        cfg = load_config(["--model.hf", "base", "--train.out_dir", "run", "--peft.method", "lora", "--peft.lora_r",
                           "4", "--peft.lora_alpha", "8", "--peft.target_modules", ",".join(LORA.target_modules)])
        claim(cfg, False, print)
        config = absolute_paths(cfg.to_dict()) if absolute else cfg.to_dict()
        meta = CheckpointMeta(model={}, config=config, peft=adapter_record(cfg, model),
                              hf_config=json.loads((root / "base" / "config.json").read_text()))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        save_checkpoint(root / "run" / "checkpoints", 3, model, optimizer, meta)
    finally:
        os.chdir(here)
    return root / "run"


@pytest.mark.parametrize("absolute", [False, True], ids=["relative", "absolute"])
def test_export_from_another_directory_finds_the_base(absolute, tmp_path, monkeypatch, capsys):
    run = lora_run(tmp_path, absolute)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert cli(["export", str(run), "adapter"]) == 0
    out = capsys.readouterr().out
    base = str(tmp_path / "base")
    assert f"tokenizer from {base}" in out and f"from_pretrained({base!r})" in out and len(out.splitlines()) == 1
    assert json.loads((tmp_path / "elsewhere/adapter" / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == base
    assert (tmp_path / "elsewhere/adapter/chat_template.jinja").is_file()
    assert cli(["export", str(run), "merged", "--peft.merge_on_export", "true"]) == 0
    assert (tmp_path / "elsewhere/merged/model.safetensors").is_file()
    assert (tmp_path / "elsewhere/merged/chat_template.jinja").is_file()


def test_model_hf_points_the_export_at_a_base_that_moved(tmp_path, capsys):
    run = lora_run(tmp_path, absolute=True)
    moved = tmp_path / "models" / "base"
    moved.parent.mkdir()
    shutil.move(tmp_path / "base", moved)
    assert cli(["export", str(run), str(tmp_path / "adapter"), "--model.hf", str(moved)]) == 0
    assert f"from_pretrained({str(moved)!r})" in capsys.readouterr().out
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(moved)
    assert (tmp_path / "adapter" / "chat_template.jinja").is_file()
    assert cli(["export", str(run), str(tmp_path / "merged"), "--model.hf", str(moved),
                "--peft.merge_on_export", "true"]) == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file() and (tmp_path / "merged" / "chat_template.jinja").is_file()
    for wrong in (tmp_path / "nowhere", tmp_path / "run"):  # not there; a directory without a config.json
        assert cli(["export", str(run), str(tmp_path / "x"), "--model.hf", str(wrong)]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and f"--model.hf {wrong} is not a Hugging Face model directory" in err, err


def test_without_its_base_an_adapter_is_written_and_a_merge_refused(tmp_path, capsys):
    run = lora_run(tmp_path, absolute=True)
    shutil.rmtree(tmp_path / "base")
    assert cli(["export", str(run), str(tmp_path / "adapter")]) == 0
    hint, note = capsys.readouterr().out.splitlines()
    assert "from_pretrained(BASE_MODEL_DIR)" in hint and str(tmp_path / "base") not in hint, hint
    assert "no tokenizer files were copied" in note and "--model.hf DIR" in note, note
    assert (tmp_path / "adapter" / ADAPTER_WEIGHTS).is_file()
    assert cli(["export", str(run), str(tmp_path / "merged"), "--peft.merge_on_export", "true"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--model.hf DIR" in err and "--peft.merge_on_export false" in err, err
    assert not (tmp_path / "merged" / "model.safetensors").exists()

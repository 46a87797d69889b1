"""mfsdp.hf, the Hugging Face boundary: every file of an export (a full model, a PEFT adapter, a
merged LoRA model) goes through the one atomic writer (mode 0644, no temporary file left); exports
take one dtype, the end-of-run export's, which the checkpoint records (an older checkpoint keeps the
rule of its time) and the disk check sizes; a bad --model.hf directory stops `mfsdp train` with one
line and exit code 2 on either route."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mfsdp.hf import files
from mfsdp.hf.export import ADAPTER_WEIGHTS
from mfsdp.train.run.resolve import load_config
from mfsdp.train.checkpoint import CheckpointMeta, save_checkpoint
from test_eval_loss import SMALL
from test_lora_save import trained  # noqa: F401 (a fixture: a LoRA run's checkpoints and base directory)

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled", "ignore::UserWarning", "ignore::FutureWarning")]


def _full_checkpoint(root, export_dtype: str | None):
    """A bundled model's full checkpoint recording ``export_dtype`` (None: from before the record)."""
    from mfsdp.models.moe import build_model

    cfg = load_config(SMALL)
    model = build_model(cfg.resolved.shape)
    meta = CheckpointMeta(model={}, config=cfg.to_dict(), export_dtype=export_dtype)
    return save_checkpoint(root, 1, model, torch.optim.AdamW(model.parameters()), meta)


@pytest.fixture
def written(monkeypatch):
    """The paths the atomic writer wrote, under umask 022."""
    paths, atomic = [], files.atomic
    monkeypatch.setattr(files, "atomic", lambda path: paths.append(os.fspath(path)) or atomic(path))
    old = os.umask(0o022)
    yield paths
    os.umask(old)


def _assert_all_atomic(out, paths):
    names = sorted(os.listdir(out))
    assert sorted(os.path.relpath(p, out) for p in paths) == names and not [n for n in names if "tmp" in n]
    assert {oct(os.stat(out / n).st_mode & 0o777) for n in names} == {"0o644"}, names


def test_every_exported_file_goes_through_the_atomic_writer(trained, written, tmp_path):  # noqa: F811
    from mfsdp.train.export import export_hf

    _, _, runs = trained
    checkpoint = _full_checkpoint(tmp_path / "run", "fp32")
    for name, source, merge in (("full", checkpoint, None), ("adapter", runs["false"], False),
                                ("merged", runs["false"], True)):
        written.clear()
        export_hf(source, tmp_path / name, merge=merge, max_shard_bytes=20_000)
        _assert_all_atomic(tmp_path / name, written)
    assert (tmp_path / "full" / files.INDEX).is_file() and (tmp_path / "adapter" / ADAPTER_WEIGHTS).is_file()


def test_an_export_takes_the_dtype_its_checkpoint_records(tmp_path):
    from mfsdp.train.export import export_hf

    for recorded, want in (("fp32", torch.float32), ("bf16", torch.bfloat16), (None, torch.bfloat16)):
        out = tmp_path / f"hf_{recorded}"
        export_hf(_full_checkpoint(tmp_path / f"run_{recorded}", recorded), out)  # None: the rule of its time
        with files.WeightFiles(out) as weights:
            assert {weights.get_slice(n)[:].dtype for n in weights.files} == {want}, recorded
        assert json.loads((out / "config.json").read_text())["dtype"] == str(want).removeprefix("torch.")


def test_the_disk_check_sizes_the_export_in_its_dtype():
    from mfsdp.models import param_counts
    from mfsdp.train.run.disk import export_bytes

    cfg = load_config([*SMALL, "--train.export_hf", "true"])
    params = param_counts(cfg.resolved.shape)["total"]
    assert (export_bytes(cfg, "cpu"), export_bytes(cfg, "cuda")) == (4 * params, 2 * params)  # the compute dtype
    assert export_bytes(load_config([*SMALL, "--train.export_hf", "true", "--train.save_dtype", "bf16"]),
                        "cpu") == 2 * params


def test_an_fp32_runs_export_is_the_same_at_the_end_and_offline(tmp_path, capsys):
    from mfsdp.cli import main as cli_main
    from mfsdp.data import prepare
    from mfsdp.data.prepare import stdlib_source

    prepare(stdlib_source(), tmp_path / "small.tokens", glob="ab*.py")
    out = tmp_path / "run"
    assert cli_main(["train", *SMALL, "--train.steps", "1", "--data.local_batch", "1", "--train.eval_every", "0",
                     "--data.path", str(tmp_path / "small.tokens"), "--train.out_dir", str(out),
                     "--train.export_hf", "true"]) == 0
    assert json.loads((out / "checkpoints" / "step_1" / "meta.json").read_text())["export_dtype"] == "fp32"
    assert cli_main(["export", str(out), str(tmp_path / "offline")]) == 0  # --dtype auto
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (tmp_path / "offline" / name).read_bytes() == (out / "hf" / name).read_bytes(), name


@pytest.mark.parametrize("route", ["bundled", "manager"])
def test_a_misshapen_tensor_is_one_error_line_on_either_route(route, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from mfsdp.cli import main as cli_main
    from mfsdp.data import prepare
    from mfsdp.data.prepare import stdlib_source
    from test_manager_models import make_hf

    source = tmp_path / "model"
    make_hf("llama", vocab=260).save_pretrained(source)
    tensors = load_file(source / files.WEIGHTS)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(8, 16)  # config.json says (24, 16)
    save_file(tensors, source / files.WEIGHTS, metadata={"format": "pt"})
    prepare(stdlib_source(), tmp_path / "small.tokens", glob="ab*.py")
    capsys.readouterr()
    code = cli_main(["train", "--model.hf", str(source), "--model.hf_impl", route, "--data.path",
                     str(tmp_path / "small.tokens"), "--data.seq_len", "16", "--train.device", "cpu",
                     "--train.out_dir", str(tmp_path / "run"), "--train.progress", "false"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"mfsdp train: error: --model.hf {source}: ")
    assert "model.layers.1.mlp.up_proj.weight in model.safetensors has shape (8, 16)" in lines[0]  # tensor, file
    assert lines[0].endswith("does config.json describe these weights?")  # the fix

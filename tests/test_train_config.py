"""Configuration of `mfsdp train`: defaults, YAML, flags, and the errors for bad keys."""

import dataclasses
import re

import pytest

from mfsdp.train.run.config import ConfigError
from mfsdp.train.run.resolve import load_config
from mfsdp.train.command.main import main
from mfsdp.train.loop.step import lr_at

pytestmark = pytest.mark.timeout(60)


def test_defaults_train_the_tiny_model_on_the_stdlib_corpus():
    cfg = load_config([])
    assert cfg.model.preset == "tiny" and cfg.data.path == "stdlib" and not cfg.resume
    assert cfg.resolved.shape.max_seq_len == cfg.data.seq_len


def test_yaml_then_flags_later_wins(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: 1b\ntrain:\n  steps: 10\n  lr: 1\n")
    cfg = load_config(["--config", str(path), "--train.steps", "20", "--resume",
                       "--parallel.activation_checkpointing=true", "--model.dim", "none"])
    assert cfg.model.preset == "1b" and cfg.train.steps == 20 and cfg.train.lr == 1.0
    assert cfg.parallel.activation_checkpointing and cfg.resume and cfg.model.dim is None


def test_the_shipped_configs_load():
    for name in ("tiny", "llama-1b", "llama-8b"):
        load_config(["--config", f"configs/{name}.yaml"]).resolved.shape


@pytest.mark.parametrize("argv, message", [
    (["--train.stepz", "3"], "unknown config key train.stepz; did you mean --train.steps? known keys of train: steps"),
    (["--optim.lr", "3"], "unknown flag --optim.lr"),
    (["--model.preset", "13b"], "unknown model preset '13b'; known presets: tiny, 1b, 8b, 70b"),
    (["--train.steps", "many"], "--train.steps expects int"),
    (["--parallel.placements", "zero4"], "parallel.placements must be one of"),
    (["--parallel.replicate", "2"], "needs --parallel.placements hsdp or hfsdp"),
    (["steps=3"], "unexpected argument"),
    (["--parallel.offload", "gpu"], "parallel.offload must be one of none, optimizer, auto"),
    (["--parallel.offload", "auto", "--parallel.offload_fraction", "0.5"], "--parallel.offload_fraction needs --parallel.offload optimizer"),
    (["--parallel.offload", "optimizer", "--parallel.offload_fraction", "0"], "offload_fraction must be in (0, 1]"),
    (["--parallel.offload_fraction", "0.5"], "--parallel.offload_fraction needs --parallel.offload optimizer"),
])
def test_bad_flags_name_the_problem(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(argv).resolved.shape


def test_offload_flags_become_the_cores_policy():
    from mfsdp import OffloadPolicy
    from mfsdp.train.build.model import offload_policy

    assert offload_policy(load_config([]).parallel) is None
    cfg = load_config(["--parallel.offload", "optimizer", "--parallel.offload_fraction", "0.5"])
    assert offload_policy(cfg.parallel) == OffloadPolicy(fraction=0.5)
    assert offload_policy(load_config(["--parallel.offload", "optimizer"]).parallel) == OffloadPolicy(fraction=1.0)


def test_stream_priority_flag_becomes_the_cores_policy():
    from mfsdp import CommunicationPolicy
    from mfsdp.train.build.model import communication_policy

    assert communication_policy(load_config([]).parallel) == CommunicationPolicy()
    assert not CommunicationPolicy().high_priority_streams
    high = load_config(["--parallel.high_priority_streams", "true"]).parallel
    assert communication_policy(high) == CommunicationPolicy(high_priority_streams=True)


def test_unknown_yaml_section_or_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optimizer:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="unknown config section 'optimizer'"):
        load_config(["--config", str(path)])
    path.write_text("train:\n  steps: ten\n")
    with pytest.raises(ConfigError, match="train.steps expects int"):
        load_config(["--config", str(path)])


def test_main_prints_one_line_for_config_errors(capsys):
    assert main(["--train.stepz", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mfsdp train: error: unknown config key")


def test_learning_rate_warms_up_then_decays_to_the_floor():
    cfg = load_config(["--train.steps", "100", "--train.warmup_steps", "10",
                       "--train.lr", "1.0", "--train.min_lr_ratio", "0.1"])
    rates = [lr_at(cfg.train, s) for s in range(1, 101)]
    assert rates[4] == pytest.approx(0.5) and rates[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))
    assert rates[-1] == pytest.approx(0.1)


def test_yaml_numbers_that_yaml_reads_as_strings(tmp_path):
    """YAML 1.1 reads 1e-3 and 1.5e1 as strings (its floats need a dot and a signed exponent), as
    torchtune and TRL configs write learning rates: float fields take them, int fields where exact."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1e-3\n  steps: 1.5e1\n  warmup_steps: 2.0\n  grad_clip: 5\n")
    t = load_config(["--config", str(path)]).train
    assert (t.lr, t.steps, t.warmup_steps, t.grad_clip) == (1e-3, 15, 2, 5.0)
    assert type(t.steps) is int and type(t.warmup_steps) is int and type(t.lr) is float
    assert load_config(["--train.steps", "1e3", "--train.lr", "3E-4"]).train.steps == 1000
    for text, message in (("steps: 1.5", "train.steps expects int, got 1.5"),
                          ("steps: 1e-1", "train.steps expects int, got '1e-1'"),
                          ("lr: fast", "train.lr expects float/NoneType, got 'fast'"),
                          ("steps: true", "train.steps expects int, got True")):
        path.write_text(f"train:\n  {text}\n")
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(["--config", str(path)])
    with pytest.raises(ConfigError, match=re.escape("--train.steps expects int, got '2.5'")):
        load_config(["--train.steps", "2.5"])


def test_help_gives_every_key_its_default_and_its_whole_docstring():
    from mfsdp.train.command.args import SECTIONS, usage

    lines = usage().splitlines()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            line = next(x for x in lines if x.startswith(f"  --{section}.{f.name} ("))
            assert len(line.split(")", 1)[1].strip()) > 10, line  # a description beside the default
    seq_len = next(x for x in lines if x.startswith("  --data.seq_len "))
    assert seq_len.split() == ["--data.seq_len", "(128)", "Tokens", "per", "training", "sequence."]
    at = next(i for i, x in enumerate(lines) if x.startswith("  --data.path "))  # a long docstring, wrapped whole
    assert lines[at].split(None, 2)[2].startswith("A token file from `mfsdp prepare-data`, or \"stdlib\": build")
    assert lines[at + 1].startswith(" " * 47 + "demo corpus") and lines[at + 2].endswith(" on first use.")
    assert "(None)" in next(x for x in lines if x.startswith("  --data.val_path "))
    assert "  --train.lr (the recipe's)" in usage() and max(map(len, lines)) <= 110


@pytest.mark.parametrize("argv, message", [
    (["--data.pth", "x"], "unknown config key data.pth; did you mean --data.path? known keys of data: path,"),
    (["--train.seq_len", "64"], "unknown config key train.seq_len; did you mean --data.seq_len?"),
    (["--trian.lr", "1"], "unknown flag --trian.lr; did you mean --train.lr?"),
    (["--resum"], "unknown flag --resum; did you mean --resume?"),
    (["--nproc-per-nod", "2"], "unknown flag --nproc-per-nod; did you mean the launcher flag --nproc-per-node?"),
    (["--zzz", "1"], "unknown flag --zzz; flags look like --SECTION.KEY with SECTION one of model, data,"),
    (["--train.lr", "--train.out_dir", "x"],
     "--train.lr needs a value, but the next argument is the flag --train.out_dir; write --train.lr VALUE"),
    (["--train.out_dir", "x", "--train.lr"], "--train.lr needs a value"),
    (["--config", "--resume"], "--config needs a value, but the next argument is the flag --resume"),
])
def test_misspelt_flags_and_missing_values_name_the_fix(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(argv)


def test_misspelt_yaml_keys_and_sections_name_the_fix(tmp_path):
    path = tmp_path / "run.yaml"
    for text, message in (("data:\n  pth: x.tokens\n", "unknown config key data.pth; did you mean data.path?"),
                          ("trian:\n  lr: 1\n", "unknown config section 'trian' in " + str(path) + "; did you "
                           "mean train? known sections: model, data, train, parallel, metrics")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(["--config", str(path)])


def test_the_worker_entry_gives_one_line_and_exit_code_2_for_a_misspelt_launcher_flag(capsys):
    """``mfsdp train --nproc-per-nod 2`` has no launcher flag, so it runs in this process: the
    error still comes before anything starts (the launcher's own path: tests/test_launcher.py)."""
    assert main(["--nproc-per-nod", "2"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["mfsdp train: error: unknown flag --nproc-per-nod; did you mean the launcher "
                                "flag --nproc-per-node?"]

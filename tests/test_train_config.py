"""Configuration of `mfsdp train`: defaults, YAML, flags, and the errors for bad keys."""

import pytest

from mfsdp.train.config import ConfigError, load_config
from mfsdp.train.main import main
from mfsdp.train.step import lr_at

pytestmark = pytest.mark.timeout(60)


def test_defaults_train_the_tiny_model_on_the_stdlib_corpus():
    cfg = load_config([])
    assert cfg.model.preset == "tiny" and cfg.data.path == "stdlib" and not cfg.resume
    assert cfg.llama_config().max_seq_len == cfg.data.seq_len


def test_yaml_then_flags_later_wins(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: 1b\ntrain:\n  steps: 10\n  lr: 1\n")
    cfg = load_config(["--config", str(path), "--train.steps", "20", "--resume",
                       "--parallel.activation_checkpointing=true", "--model.dim", "none"])
    assert cfg.model.preset == "1b" and cfg.train.steps == 20 and cfg.train.lr == 1.0
    assert cfg.parallel.activation_checkpointing and cfg.resume and cfg.model.dim is None


def test_the_shipped_configs_load():
    for name in ("tiny", "llama-1b", "llama-8b"):
        load_config(["--config", f"configs/{name}.yaml"]).llama_config()


@pytest.mark.parametrize("argv, message", [
    (["--train.stepz", "3"], "unknown config key train.stepz; known keys of train: steps"),
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
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(argv).llama_config()


def test_offload_flags_become_the_cores_policy():
    from mfsdp import OffloadPolicy
    from mfsdp.train.build import offload_policy

    assert offload_policy(load_config([]).parallel) is None
    cfg = load_config(["--parallel.offload", "optimizer", "--parallel.offload_fraction", "0.5"])
    assert offload_policy(cfg.parallel) == OffloadPolicy(fraction=0.5)
    assert offload_policy(load_config(["--parallel.offload", "optimizer"]).parallel) == OffloadPolicy(fraction=1.0)


def test_stream_priority_flag_becomes_the_cores_policy():
    from mfsdp import CommunicationPolicy
    from mfsdp.train.build import communication_policy

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

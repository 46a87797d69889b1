"""What a resume says about the run it continues: a learning-rate schedule rebuilt for changed
``--train`` settings (raised ``--train.steps`` on a finished run, say) in one line, old against new;
and the absolute paths that checkpoints record, so a run is found again from any directory."""

import os

from mfsdp.train.run.resolve import load_config
from mfsdp.train.checkpoint import CheckpointMeta
from mfsdp.train.run.run_dir import absolute_paths, identity, schedule_change_line


def meta_of(*argv, step: int) -> CheckpointMeta:
    return CheckpointMeta(model={}, config=load_config(list(argv)).to_dict(), step=step)


def test_raising_the_steps_of_a_finished_run_says_how_the_schedule_is_rebuilt():
    """As a fine-tuning run re-derives its warm-up (a tenth of the run): 10 steps of 100, 15 of 150."""
    finished = meta_of("--train.steps", "100", "--train.lr", "0.003", "--train.min_lr_ratio", "0",
                       "--train.warmup_steps", "10", step=100)
    raised = load_config(["--train.steps", "150", "--train.lr", "0.003", "--train.min_lr_ratio", "0",
                          "--train.warmup_steps", "15"])
    assert schedule_change_line(finished, raised) == (
        "the learning-rate schedule is rebuilt for --train.steps 150 (the checkpoint's run had 100): was warm-up "
        "10 steps then cosine to 0x over steps 11-100 (lr 0.003), now warm-up 15 steps then cosine to 0x over "
        "steps 16-150 (lr 0.003); lr 0 at step 100, 0.000874 at step 101")


def test_a_resume_with_the_same_schedule_or_no_record_of_it_says_nothing():
    argv = ["--train.steps", "100"]
    assert schedule_change_line(meta_of(*argv, step=40), load_config(argv)) is None
    assert schedule_change_line(CheckpointMeta(model={}, step=40), load_config(argv)) is None  # format 0: no config
    # A changed steps-independent setting is said as well (a constant schedule has no decay).
    line = schedule_change_line(meta_of(*argv, step=40), load_config([*argv, "--train.lr_schedule", "constant"]))
    assert line.startswith("the learning-rate schedule is rebuilt for --train.steps 100 (the checkpoint's run had "
                           "100)") and "now warm-up 20 steps then constant over steps 21-100" in line, line


def test_checkpoints_record_the_base_and_data_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = {"model": {"hf": "base", "preset": "tiny"}, "data": {"path": "corpus.tokens", "val_path": None},
              "train": {"lr": 0.1}}
    absolute = absolute_paths(config)
    assert absolute["model"] == {"hf": str(tmp_path / "base"), "preset": "tiny"}
    assert absolute["data"] == {"path": str(tmp_path / "corpus.tokens"), "val_path": None}
    assert config["model"]["hf"] == "base"  # the given config is left as it was
    assert absolute_paths({"data": {"path": "stdlib"}, "model": None}) == {"data": {"path": "stdlib"}, "model": None}
    # A checkpoint written with relative paths (before they were recorded absolute) is the same run.
    os.chdir(tmp_path)
    assert identity(config) == identity(absolute)

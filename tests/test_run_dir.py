"""Runs that never mix: one run per --train.out_dir (another is refused unless it resumes or says
--train.overwrite true), `latest` never names a deleted checkpoint, --resume without a checkpoint is an
error (--resume auto starts afresh), a resume at its last step says so and exits 0; and what a run
reports on the way: lines for batch logs (--train.progress false) and Weights & Biases, offline."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from test_eval_loss import SMALL
from mfsdp.data import prepare
from mfsdp.data.prepare import stdlib_source
from mfsdp.train.checkpoint import CheckpointMeta, find_latest
from mfsdp.train.checkpoint.storage import paths, publish_when_written
from mfsdp.train.run.resolve import load_config
from mfsdp.train.command.errors import ConfigError
from mfsdp.train.run.preflight import check_run
from mfsdp.train.run.run_dir import RUN_FILE, claim

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

RUN = [*SMALL, "--train.steps", "4", "--train.checkpoint_every", "0", "--train.eval_every", "0",
       "--data.local_batch", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("rundir") / "small.tokens"
    prepare(stdlib_source(), path, glob="a*.py")
    return path


def logged_run(rank, world_size, argv, wandb_dir):
    """One run in this rank with W&B offline in ``wandb_dir``: its exit code, what it printed and
    what it handed to ``wandb.Run.log``. The environment and wandb are restored after (the world's
    processes outlive the test)."""
    import contextlib
    import io

    import wandb

    from mfsdp.train.run.preflight import preflight
    from mfsdp.train.loop.trainer import Trainer

    env = {"WANDB_MODE": "offline", "WANDB_DIR": wandb_dir, "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}
    saved, original, logged = {k: os.environ.get(k) for k in env}, wandb.Run.log, []

    def spy(self, data, step=None, **kwargs):
        logged.append((step, dict(data)))
        return original(self, data, step=step, **kwargs)

    os.environ.update(env)
    wandb.Run.log = spy
    printed, cpu = io.StringIO(), torch.device("cpu")
    try:
        with contextlib.redirect_stdout(printed):
            code = Trainer(preflight(load_config(argv), cpu, print), cpu).run()
    finally:
        wandb.Run.log = original
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    return code, printed.getvalue(), logged


@pytest.fixture(scope="module")
def finished(world, corpus, tmp_path_factory):
    """A finished 4-step run with batch lines every 2 steps and W&B offline, then its --resume."""
    pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("finished")
    argv = [*RUN, "--data.path", str(corpus), "--train.out_dir", str(root / "run"), "--metrics.log_every", "2",
            "--metrics.wandb", "true", "--metrics.wandb_project", "tests"]
    first = world(1).run(logged_run, argv=argv, wandb_dir=str(root / "wandb"))[0]
    again = world(1).run(logged_run, argv=[*argv, "--resume"], wandb_dir=str(root / "wandb"))[0]
    return root, argv, first, again


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_batch_logs_get_a_line_every_log_every_steps(finished):
    _, _, (code, printed, _), _ = finished
    lines = [line for line in printed.splitlines() if line.startswith("step ")]
    assert code == 0 and [line.split(":")[0] for line in lines] == ["step 1/4", "step 2/4", "step 4/4"], printed
    for line in lines:
        assert all(word in line for word in (": loss ", ", lr ", " tok/s, ETA ")), line
    assert lines[-1].endswith("ETA 0s")


def test_wandb_offline_logs_the_scalars_of_metrics_jsonl(finished):
    from mfsdp.train.report.metrics import scalars

    root, _, (_, _, logged), _ = finished
    out = root / "run"
    assert logged == [(r["step"], scalars(r)) for r in records(out)] and len(logged) == 4
    assert {"loss", "lr", "tokens_per_s", "grad_norm"} <= set(logged[0][1])
    run_id = (out / "wandb-run-id").read_text().strip()
    assert list((root / "wandb" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


def test_a_resume_at_the_last_step_says_so_and_exits_0(finished, capsys):
    from mfsdp.train.command.launcher import main as launch

    root, argv, _, (code, printed, logged) = finished
    out = root / "run"
    assert code == 0 and logged == [] and len(records(out)) == 4
    line = f"{out / 'checkpoints' / 'step_4'} is at step 4, the last of --train.steps 4: nothing left to train"
    assert line in printed and "step 1/" not in printed, printed
    # The launcher says it before any worker starts.
    assert launch(["--nproc-per-node", "1", *argv, "--resume"]) == 0
    assert capsys.readouterr().out.startswith(line)


def test_another_run_is_refused_the_directory_in_one_line(finished, tmp_path, capsys):
    from mfsdp.train.command.launcher import main as launch

    root, argv, _, _ = finished
    out = root / "run"
    identity = json.loads((out / RUN_FILE).read_text())["identity"]
    assert identity["model.dim"] == 32 and identity["data.path"].endswith("small.tokens")
    other = tmp_path / "other.tokens"
    prepare(stdlib_source(), other, glob="b*.py")
    fine_tune = [*argv, "--data.path", str(other)]  # another data set, same out_dir
    with pytest.raises(ConfigError) as err:
        check_run(load_config(fine_tune), 1, "cpu")
    message = str(err.value)
    assert "\n" not in message and f"--train.out_dir {out} holds another run's checkpoints or metrics (data.path " \
        in message and "--resume" in message and "--train.overwrite true" in message, message
    assert launch(["--nproc-per-node", "1", *fine_tune]) == 2  # from the launcher, before any worker
    assert capsys.readouterr().err.strip() == f"mfsdp train: error: {message}"
    check_run(load_config([*argv, "--train.steps", "8", "--resume"]), 1, "cpu")  # the same run, longer
    with pytest.raises(ConfigError) as err:  # the same run afresh would delete its checkpoints
        check_run(load_config([*argv, "--train.steps", "8"]), 1, "cpu")
    assert str(err.value) == (f"--train.out_dir {out} holds this run's checkpoints (the newest step_4); continue "
                              "it with --resume, start it over with --train.overwrite true (deletes them), or "
                              "give this run its own --train.out_dir")
    check_run(load_config([*argv, "--train.overwrite", "true"]), 1, "cpu")
    check_run(load_config([*fine_tune, "--train.overwrite", "true"]), 1, "cpu")


def test_overwrite_removes_the_other_run_before_this_one_writes(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_300").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / RUN_FILE).write_text(json.dumps({"identity": {"model.preset": "1b"}}))
    (out / "data").mkdir()  # the demo corpus's cache stays
    argv = ["--train.out_dir", str(out), "--train.device", "cpu"]
    with pytest.raises(ConfigError, match=r"\(model.preset '1b' there, 'tiny' now\)"):
        check_run(load_config(argv), 1, "cpu")
    cfg = load_config([*argv, "--train.overwrite", "true"])
    check_run(cfg, 1, "cpu")
    lines = []
    claim(cfg, False, lines.append)
    assert sorted(p.name for p in out.iterdir()) == ["data", RUN_FILE]
    assert lines == [f"starting afresh in {out}: removed the earlier run's checkpoints, metrics.jsonl"]
    assert json.loads((out / RUN_FILE).read_text())["identity"]["model.preset"] == "tiny"


def test_resume_without_a_checkpoint_is_an_error_and_auto_starts_afresh(tmp_path):
    argv = ["--train.out_dir", str(tmp_path / "empty"), "--train.device", "cpu"]
    with pytest.raises(ConfigError) as err:
        check_run(load_config([*argv, "--resume"]), 1, "cpu")
    assert "\n" not in str(err.value) and str(err.value).startswith(
        f"--resume: no checkpoint to continue from in {tmp_path / 'empty' / 'checkpoints'}; drop --resume")
    assert "--resume auto" in str(err.value)
    for auto in (["--resume", "auto"], ["--resume=auto"]):
        cfg = load_config([*argv, *auto])
        assert cfg.resume == "auto" and check_run(cfg, 1, "cpu").resume_from is None


def test_the_default_out_dir_is_the_model_s(tmp_path):
    from mfsdp.train.run.config import ModelSection

    assert load_config([]).train.out_dir == "runs/tiny"
    assert load_config(["--model.preset", "moe-tiny"]).train.out_dir == "runs/moe-tiny"
    assert ModelSection(hf=str(tmp_path / "Llama-3.2-1B")).default_out_dir() == "runs/Llama-3.2-1B"
    assert load_config(["--train.out_dir", "x"]).train.out_dir == "x"


def test_latest_never_names_a_deleted_checkpoint(tmp_path):
    """The issue's sequence: another run's step_200 and step_300 in the directory, then a run whose
    first save is step 50, with keep_checkpoints 2. Pruning by step number alone deleted step_50,
    the checkpoint `latest` had just been pointed at."""
    root = tmp_path / "checkpoints"
    meta = CheckpointMeta(model={"dim": 1})

    def save(step, keep=2):
        temp = paths(root, step)[1]
        temp.mkdir(parents=True)
        (temp / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))  # DCP's, of no tensor
        publish_when_written(root, step, meta, keep, None)

    for step in (200, 300):
        save(step)
    save(50)
    assert (root / "latest").read_text().strip() == "step_50" and find_latest(root) == root / "step_50"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_50"]  # the abandoned 200 and 300 went
    for step in (100, 150):
        save(step)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_100", "step_150"]
    save(200, keep=1)
    assert [p.name for p in root.glob("step_*")] == ["step_200"] == [(root / "latest").read_text().strip()]

"""The seam for training objectives (``mfsdp.train.objectives``): an objective defined here, outside
the library, trains through `mfsdp train` with its own metric names, count and first pass, and the
step, the validation pass, the step lines, metrics.jsonl, TensorBoard and the plot show them with no
edit of the library; the causal LM's own names (``loss``, ``val_loss``, ``loss_tokens``) appear nowhere."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mfsdp.data import write_token_file
from mfsdp.train.objectives import CausalLM, Objective
from test_train_e2e import in_process

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


class HalfLossAndWidth(Objective):
    """Half the cross entropy, and each window's length as a metric, normalised by the windows: names,
    count and loss the library never spells."""

    metrics = ("half_ce", "width")
    count_name = "windows"
    line_names = {"val_half_ce": "held-out"}

    def __init__(self):
        self.prepared = []

    def global_count(self, sampler, step: int) -> int:
        return sampler.microbatches * sampler.world_size * sampler.local_batch

    def prepare(self, model, sampler, evaluator, log) -> None:
        self.prepared.append(evaluator is not None)
        log("test objective: first pass done")

    def __call__(self, model, batch, device):
        ce, _, _ = CausalLM()(model, batch, device)
        windows, width = batch.inputs.shape
        # Per window: half its mean cross entropy (every target counts in a token file).
        return ce / (2 * width), torch.tensor(windows), {"half_ce": ce.detach() / (2 * width),
                                                        "width": torch.tensor(float(windows * width))}


ARGS = ["--model.n_layers", "1", "--model.dim", "32", "--model.n_heads", "2", "--model.n_kv_heads", "2",
        "--model.ffn_dim", "64", "--data.seq_len", "16", "--data.local_batch", "2", "--data.microbatches", "2",
        "--train.steps", "4", "--train.eval_every", "2", "--train.eval_batches", "2", "--train.lr", "1e-2",
        "--train.warmup_steps", "1", "--train.sample_tokens", "0", "--train.progress", "false",
        "--train.device", "cpu", "--metrics.log_every", "2", "--metrics.tensorboard", "true"]


def _run(capsys, tmp_path, name: str):
    data = tmp_path / "t.tokens"
    if not data.exists():
        write_token_file(data, torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(0)), 257,
                         "bytes")
    result = in_process(capsys, *ARGS, "--data.path", str(data), "--train.out_dir", str(tmp_path / name))
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return result.stdout, records


def test_an_objective_from_outside_the_library_trains_and_reports_its_own_metrics(capsys, tmp_path, monkeypatch):
    _, baseline = _run(capsys, tmp_path, "causal_lm")
    objective = HalfLossAndWidth()
    monkeypatch.setattr("mfsdp.train.loop.trainer.objective_for", lambda cfg, data: objective)
    reduced = []  # the step's collectives: one a step, its metrics, stop votes and aux loss together
    monkeypatch.setattr("mfsdp.train.loop.step.dist", SimpleNamespace(
        get_world_size=dist.get_world_size, all_reduce=lambda t: reduced.append(t.numel()) or dist.all_reduce(t)))
    printed, records = _run(capsys, tmp_path, "custom")
    assert reduced == [len(objective.metrics) + 2] * 4
    assert objective.prepared == [True] and "test objective: first pass done" in printed
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert list(r)[:4] == ["step", "half_ce", "width", "lr"]
        assert r["windows"] == 4 and r["windows_per_s"] == pytest.approx(4 / r["step_time_s"])
        assert r["width"] == 16.0  # the tokens of a window, its mean over the global batch's windows
        assert not {"loss", "val_loss", "loss_tokens", "loss_tokens_per_s"} & set(r)
    # Every target counts: the mean over windows of half their mean is half the token mean.
    assert records[0]["half_ce"] == pytest.approx(baseline[0]["loss"] / 2, rel=1e-5)
    evaluated = [r for r in records if "val_half_ce" in r]
    assert [r["step"] for r in evaluated] == [2, 4] and all(r["val_width"] == 16.0 for r in evaluated)
    last = records[-1]
    assert (f"step 4/4: half_ce {last['half_ce']:.4f}, width 16.0000, held-out {last['val_half_ce']:.4f}, "
            f"val_width 16.0000, lr ") in printed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "custom" / "tensorboard"))
    events.Reload()
    assert {"half_ce", "width", "val_half_ce", "val_width", "windows"} <= set(events.Tags()["scalars"])
    assert (tmp_path / "custom" / "loss.png").stat().st_size > 0

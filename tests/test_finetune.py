"""Fine-tuning in ``mfsdp train``: the loss is the mean over the counted targets of the whole global
batch (not a mean of per-microbatch or per-rank means), packed samples train end to end with their
masks, epochs and the validation loss, and a global batch that counts nothing is skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mfsdp
from mfsdp.cli import main as cli_main
from mfsdp.data import PackedSampler, TokenFile, write_token_file
from mfsdp.mesh import build_mesh
from mfsdp.models.llama import Llama, LlamaConfig
from mfsdp.models.parallelize import ParallelizeConfig, parallelize
from mfsdp.train.objectives import CausalLM
from mfsdp.train.loop.step import train_step
from test_eval_loss import run_trainer
from test_train_e2e import in_process
CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=96, max_seq_len=16)
SEQ = 16


def _samples(path: Path) -> Path:
    """Samples of random lengths whose loss masks count very different shares of their tokens, so
    the windows of one global batch count different numbers of targets."""
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(3, 15, (24,), generator=g).tolist()
    ids = torch.randint(0, CFG.vocab_size, (sum(lengths),), generator=g)
    mask = torch.cat([torch.arange(n) >= int(torch.randint(1, n, (), generator=g)) for n in lengths])
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    return write_token_file(path, ids, CFG.vocab_size, "bytes", loss_mask=mask, sample_starts=starts)


def _model() -> Llama:
    model = Llama(CFG)
    model.init_weights(seed=3)
    return model


def sgd_update(rank, world_size, data_path, local_batch, microbatches):
    """The weights after one SGD step (lr 1, no clipping) of ``train_step``: each minus its gradient."""
    model = _model()
    parallelize(model, build_mesh("cpu", world_size), ParallelizeConfig(placements="zero3"))
    optimizer = mfsdp.fully_shard_optimizer(model, torch.optim.SGD(model.parameters(), lr=1.0))
    sampler = PackedSampler(TokenFile(data_path), SEQ, local_batch, rank, world_size, seed=5,
                            microbatches=microbatches)
    out = train_step(model, optimizer, CausalLM(), lambda micro: sampler.batch(1, micro), microbatches,
                     sampler.loss_tokens(1), 1.0, 0.0, None, False, torch.device("cpu"))
    weights = {name: q.full_tensor().detach() for name, q in model.named_parameters()}
    return {"weights": weights, "loss_sum": float(out.metrics["loss"]), "loss_tokens": sampler.loss_tokens(1)}


@pytest.mark.parametrize("world_size,local_batch,microbatches", [(1, 1, 4), (2, 1, 2), (1, 4, 1)])
def test_the_step_gives_the_full_batch_gradient_at_every_split(world, tmp_path, world_size, local_batch, microbatches):
    data_path = _samples(tmp_path / "s.tokens")
    whole = PackedSampler(TokenFile(data_path), SEQ, 4, 0, 1, seed=5)  # the same 4 windows in one batch
    batch = whole.batch(1)
    counted = (batch.targets != -100).sum(dim=1)
    assert len(set(counted.tolist())) > 1, "the windows must count different numbers of targets"
    assert whole.loss_tokens(1) == int(counted.sum())
    reference = _model()
    loss, count = reference(batch.inputs, positions=batch.positions, document_ids=batch.document_ids,
                            labels=batch.targets)
    (loss / count).backward()
    out = world(world_size).run(sgd_update, data_path=str(data_path), local_batch=local_batch,
                                microbatches=microbatches)[0]
    assert out["loss_tokens"] == int(count)
    assert out["loss_sum"] / out["loss_tokens"] == pytest.approx(float(loss.detach() / count), rel=1e-6)
    for name, q in reference.named_parameters():
        expected = q.detach() - q.grad
        error = (out["weights"][name] - expected).abs().max().item()
        assert error < 1e-5, (name, error)


def test_loss_tokens_count_every_rank_and_microbatch_of_the_step(tmp_path):
    data = TokenFile(_samples(tmp_path / "s.tokens"))
    for step in (1, 2, 3, 4):
        parts = [PackedSampler(data, SEQ, 2, rank, 2, seed=1, microbatches=2) for rank in range(2)]
        counted = sum(int((s.batch(step, m).targets != -100).sum()) for s in parts for m in range(2))
        assert all(s.loss_tokens(step) == counted for s in parts)


# ------------------------------------------------------------------------------- end to end
def _rows(path: Path, n: int, long_prompt: bool = False) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{2 * i}"}]} for i in range(n)]
    if long_prompt:  # truncated to its prompt: a window that counts nothing
        rows = [{"prompt": "x" * 200, "completion": "y"}] + [
            {"prompt": f"q{i} ", "completion": f"a{i}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(tmp_path: Path, data: Path, *flags: str) -> list[str]:
    return ["--data.path", str(data), "--train.out_dir", str(tmp_path / "run"), "--train.device", "cpu",
            "--train.progress", "false", "--model.preset", "tiny", "--model.dim", "32", "--model.n_layers", "1",
            "--model.n_heads", "2", "--model.n_kv_heads", "2", "--model.ffn_dim", "64", *flags]


def _train(world, tmp_path: Path, data: Path, *flags: str) -> str:
    """``mfsdp train`` in one process (the trainer in a world of one; the launch itself is
    test_train_e2e.py's); returns what it printed."""
    return world(1).run(run_trainer, argv=_args(tmp_path, data, *flags), stdout=True)[0][1]


def _prepare(source: Path, out: Path) -> None:
    assert cli_main(["prepare-data", str(source), str(out)]) == 0


def test_chat_samples_train_by_epochs_with_masked_metrics_validation_and_a_chat_sample(world, tmp_path):
    data = tmp_path / "chat.tokens"
    _prepare(_rows(tmp_path / "chat.jsonl", 60), data)
    printed = _train(world, tmp_path, data, "--data.seq_len", "64", "--data.local_batch", "2", "--train.epochs", "2",
                     "--data.val_fraction", "0.1", "--train.eval_every", "3", "--train.sample_tokens", "8",
                     "--train.checkpoint_every", "0", "--train.profile_step", "2")
    first = printed.splitlines()[0]
    samples = TokenFile(data)
    sampler = PackedSampler(samples, 64, 2, 0, 1, samples=range(60 - 6))
    steps = 2 * sampler.steps_per_epoch
    assert f"60 samples ({len(samples):,} tokens) in {data}, 2 epoch(s) of {sampler.steps_per_epoch} steps" in first
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert r["loss_tokens"] == sampler.loss_tokens(r["step"]) > 0
        assert r["loss_tokens"] < r["tokens_per_s"] * r["step_time_s"]  # the prompts are not counted
        assert r["loss_tokens_per_s"] == pytest.approx(r["loss_tokens"] / r["step_time_s"])
    assert any("val_loss" in r for r in records) and "val_loss" in records[-1]
    assert "validation loss every 3 steps and at the end" in printed and "the last 6 samples" in printed
    assert "--- sample (temperature 0.8, mfsdp's chat template; user: 'Write a short greeting.')" in printed
    meta = json.loads((tmp_path / "run" / "checkpoints" / f"step_{steps}" / "meta.json").read_text())
    assert meta["held_out"]["samples"] == 6
    # --train.profile_step 2: a trace per rank and the step by phase.
    profile = tmp_path / "run" / "profile"
    assert [r["step"] for r in records if r.get("profiled")] == [2]
    assert json.loads((profile / "step_2_rank0.json").read_text())["traceEvents"]
    table = (profile / "step_2_breakdown.md").read_text()
    for phase in ("mfsdp.train.data", "mfsdp.train.forward_backward", "mfsdp.train.optimizer_step",
                  "mfsdp.model.head_and_loss"):
        assert f"| {phase} | " in table, table
    assert f"profiled step 2: {profile / 'step_2_rank0.json'}" in printed


def test_a_global_batch_counting_nothing_is_skipped_and_never_a_nan(world, tmp_path):
    data = tmp_path / "pc.tokens"
    _prepare(_rows(tmp_path / "pc.jsonl", 7, long_prompt=True), data)
    printed = _train(world, tmp_path, data, "--data.seq_len", "32", "--data.local_batch", "1", "--train.epochs", "1",
                     "--data.val_fraction", "0", "--train.sample_tokens", "0", "--train.checkpoint_every", "0")
    sampler = PackedSampler(TokenFile(data), 32, 1, 0, 1)
    empty = [s for s in range(1, sampler.steps_per_epoch + 1) if sampler.loss_tokens(s) == 0]
    assert len(empty) == 1 and f"step {empty[0]}: the global batch counts no target" in printed
    assert f"mfsdp train: 1 of 8 samples in {data} are longer than --data.seq_len 32 and are cut to it" in printed
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert empty[0] not in [r["step"] for r in records] and len(records) == sampler.steps_per_epoch - 1
    assert all(r["loss"] == r["loss"] and r["loss_tokens"] > 0 for r in records)


def test_epochs_need_a_file_of_samples(tmp_path, capsys):
    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": "hello world " * 20}) + "\n" for _ in range(20)))
    _prepare(text, tmp_path / "t.tokens")
    done = in_process(capsys, *_args(tmp_path, tmp_path / "t.tokens", "--train.epochs", "1"))
    assert done.returncode == 2 and "--train.epochs needs a file of samples" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr

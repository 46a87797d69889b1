"""Asynchronous checkpoints (``--train.async_checkpoint``): staged copies, background writes that
training does not wait for, and crash safety while a write is in flight.

Two kinds of test: ``Checkpointer`` in one process without a process group (fast), and the training
loop on two ranks (tests/_async_ckpt_worker.py) whose storage writer the test holds back (in the
session's world) or kills (a real torchrun launch, since a rank dies). Nothing here depends on
timing: a held write waits for an event (the training loop logging a later step), not for a clock.
"""

import json
import re
import subprocess
import sys
from concurrent.futures import wait as wait_futures

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mfsdp.train.checkpoint import (CheckpointError, Checkpointer, HostStager, checkpoint_bytes, damage, find_latest,
                                    find_resumable, load_checkpoint, staging_bytes)
from mfsdp.train.checkpoint import async_save as ckpt
from mfsdp.train.checkpoint.storage import state_of
from mfsdp.train.report.record import postfix
from test_train_checkpoint import META, make
from test_train_e2e import REPO, SMALL, _env, corpus, loss_and_grad_norm, stopped_copy  # noqa: F401

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

WORKER = REPO / "tests" / "_async_ckpt_worker.py"
ASYNC = [*SMALL, "--train.async_checkpoint", "true", "--train.steps", "8",
         "--train.checkpoint_every", "4", "--train.sample_tokens", "0"]


# ------------------------------------------------------------------ one process


def test_an_async_save_holds_the_state_of_its_step_while_training_goes_on(tmp_path):
    model, optimizer = make(0)
    saved = model.weight.detach().clone()
    saver = Checkpointer(tmp_path, keep=2, asynchronous=True)
    path = saver.save(1, model, optimizer, META)
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step changes the weights while the write runs
    # Published only once the write is known to have ended everywhere (poll, wait, close).
    assert find_latest(tmp_path) is None and saver.writing == "step_1"
    saver.close()
    assert find_latest(tmp_path) == path and (tmp_path / "latest").read_text() == "step_1\n"
    fresh, fresh_optimizer = make(3)
    assert load_checkpoint(path, fresh, fresh_optimizer).step == 1
    torch.testing.assert_close(fresh.weight, saved, rtol=0, atol=0)


def test_the_staging_buffers_are_reused_from_one_save_to_the_next(tmp_path):
    model, optimizer = make(0)
    stager = HostStager(pinned=False)
    first = stager.stage(state_of(model, optimizer))
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    second = stager.stage(state_of(model, optimizer))
    assert second["model"]["weight"].data_ptr() == first["model"]["weight"].data_ptr()
    assert second["optimizer"]["state"]["weight"]["exp_avg"].data_ptr() == \
        first["optimizer"]["state"]["weight"]["exp_avg"].data_ptr()
    torch.testing.assert_close(second["model"]["weight"], model.weight.detach(), rtol=0, atol=0)
    assert second["model"]["weight"].data_ptr() != model.weight.data_ptr()  # a copy, not a view
    state = state_of(model, optimizer)
    assert stager.nbytes() == staging_bytes(state)
    n = model.weight.numel() + model.bias.numel()
    # weights and two AdamW moments, plus the step counters and the generator state
    assert checkpoint_bytes(n) <= staging_bytes(state) <= checkpoint_bytes(n) + 8192


def fake_cuda(monkeypatch, pin=None):
    """The pinned path's CUDA calls recorded instead of made (CPU only): returns the record."""
    calls = []
    monkeypatch.setattr(ckpt._compat, "pin_host_memory",
                        pin or (lambda t: calls.append(("pin", t.numel()))))
    monkeypatch.setattr(ckpt._compat, "unpin_host_memory", lambda t: calls.append(("unpin", t.numel())))
    monkeypatch.setattr(ckpt, "_wait_for_copies", lambda: calls.append("wait"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    return calls


def test_on_cuda_the_buffer_is_pinned_once_for_exactly_its_bytes(monkeypatch):
    calls = fake_cuda(monkeypatch)
    model, optimizer = make(0)
    stager = HostStager(pinned=True)
    for _ in range(3):
        stager.stage(state_of(model, optimizer))
    state = state_of(model, optimizer)
    # One wait for the device per save, not one per tensor.
    assert calls == [("pin", staging_bytes(state)), "wait", "wait", "wait"]
    stager.close()
    assert calls[-1] == ("unpin", staging_bytes(state)) and stager.nbytes() == 0


def test_the_buffer_is_pinned_in_the_background_before_the_first_save(monkeypatch, tmp_path):
    """Built with an optimizer that has state (as on resume), the Checkpointer starts page-locking
    at once, on the training's device; the first save finds the buffer ready and pins nothing."""
    calls = fake_cuda(monkeypatch)
    model, optimizer = make(0)
    saver = Checkpointer(tmp_path, keep=2, asynchronous=True, pinned=True, model=model,
                         optimizer=optimizer)
    saver._stager._join()  # the background thread has finished
    state = state_of(model, optimizer)
    assert calls == [("set_device", 0), ("pin", staging_bytes(state))]
    saver.save(1, model, optimizer, META)
    assert calls[2:] == ["wait"] and saver._write.stall.pinning < 0.5
    saver.close()
    assert calls[-1] == ("unpin", staging_bytes(state))


def test_a_fresh_run_pins_after_its_first_step_without_touching_the_optimizer(tmp_path):
    """Before the first step AdamW has no state: asking DCP for its state dict then would run a
    step of its own. The Checkpointer waits for the first poll after a step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    saver = Checkpointer(tmp_path, keep=2, asynchronous=True, model=model, optimizer=optimizer)
    assert not optimizer.state and saver._stager._thread is None and saver._stager.nbytes() == 0
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    saver.poll(1)
    assert saver._stager.nbytes() == staging_bytes(state_of(model, optimizer))
    assert optimizer.state[model.weight]["step"].item() == 1  # one step, the training's
    saver.close()


def test_background_pinning_does_not_change_the_bytes_saved(tmp_path):
    """A checkpoint staged in the buffer made in the background, one staged at the save and a
    synchronous one hold the same bytes, file for file (``.metadata`` also names its directory and
    a save id: its tensor entries and where they lie are compared instead, and so its size in
    meta.json)."""
    model, optimizer = make(0)
    prepared = Checkpointer(tmp_path / "prepared", keep=2, asynchronous=True, model=model,
                            optimizer=optimizer)
    assert prepared._stager._thread is not None or prepared._stager.nbytes() > 0
    paths = [prepared.save(3, model, optimizer, META)]
    prepared.close()
    at_save = Checkpointer(tmp_path / "at_save", keep=2, asynchronous=True)
    paths.append(at_save.save(3, model, optimizer, META))
    at_save.close()
    paths.append(ckpt.save_checkpoint(tmp_path / "sync", 3, model, optimizer, META))
    names = sorted(p.name for p in paths[0].iterdir())
    assert "__0_0.distcp" in names
    for other in paths[1:]:
        assert sorted(p.name for p in other.iterdir()) == names
        for name in names:
            if name not in (".metadata", "meta.json"):
                assert (other / name).read_bytes() == (paths[0] / name).read_bytes(), name
        mine, theirs = (json.loads((p / "meta.json").read_text()) for p in (paths[0], other))
        assert {**theirs, "files": {**theirs["files"], ".metadata": 0}} == \
            {**mine, "files": {**mine["files"], ".metadata": 0}}
        mine, theirs = (dcp.FileSystemReader(p).read_metadata() for p in (paths[0], other))
        assert theirs.state_dict_metadata == mine.state_dict_metadata
        assert theirs.storage_data == mine.storage_data


def test_staged_tensors_own_exactly_their_bytes_and_the_writer_copies_nothing_ahead(
        tmp_path, monkeypatch):
    """DCP's writer clones a CPU tensor whose storage is larger than it (a plain view of the flat
    buffer would be: a second copy of every byte), and with copy-ahead on it syncs a CUDA stream
    of its own thread every 10 MB."""
    model, optimizer = make(0)
    stager = HostStager(pinned=False)
    leaves = ckpt._leaves(stager.stage(state_of(model, optimizer)))
    assert leaves and all(t.untyped_storage().size() == t.nbytes for t in leaves.values())
    writers = []

    class Recorded(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            writers.append(self.per_thread_copy_ahead)
            return super().write_data(plan, planner)

    monkeypatch.setattr(ckpt, "_storage_writer", Recorded)
    saver = Checkpointer(tmp_path, keep=2, asynchronous=True)
    saver.save(1, model, optimizer, META)
    saver.close()
    assert writers == [0]


def test_the_save_line_splits_the_stall(tmp_path):
    lines = []
    model, optimizer = make(0)
    saver = Checkpointer(tmp_path, keep=2, asynchronous=True, log=lines.append, model=model,
                         optimizer=optimizer)
    saver.save(1, model, optimizer, META)
    saver.save(2, model, optimizer, META)
    saver.close()
    pattern = (r"checkpoint step_{} saved: training waited ([0-9.]+) s to stage it \(previous "
               r"write ([0-9.]+) s, copy ([0-9.]+) s, planning ([0-9.]+) s\), then it was written "
               r"in the background in [0-9.]+ s, (over steps 2-2|as the run ended)({})")
    for step, line in zip((1, 2), lines):
        made = (r"; its staging buffer \(0.0 GiB\) was allocated in the background in [0-9.]+ s"
                if step == 1 else "")
        found = re.fullmatch(pattern.format(step, made), line)
        assert found, line
        total, *parts = map(float, found.groups()[:4])
        assert abs(total - sum(parts)) <= 0.03, line


def test_a_failed_background_pinning_is_the_one_line_of_a_failed_save(tmp_path, monkeypatch):
    def refuse(tensor):
        raise RuntimeError("pinning 0.0 GiB of host memory failed (cudaError 2)")

    fake_cuda(monkeypatch, pin=refuse)
    model, optimizer = make(0)
    saver = Checkpointer(tmp_path, keep=2, asynchronous=True, pinned=True, model=model,
                         optimizer=optimizer)
    with pytest.raises(CheckpointError, match=r"saving checkpoint step_1 failed \(RuntimeError: "
                       r"pinning 0.0 GiB of host memory failed"):
        saver.save(1, model, optimizer, META)
    assert find_latest(tmp_path) is None and not (tmp_path / ".tmp-step_1").exists()
    monkeypatch.setattr(ckpt._compat, "pin_host_memory", lambda t: None)  # the next save retries
    path = saver.save(2, model, optimizer, META)
    saver.close()
    assert find_latest(tmp_path) == path


class FullDisk(dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        raise OSError(28, "No space left on device")


def test_a_failed_background_write_is_the_one_line_of_a_failed_save(tmp_path, monkeypatch):
    model, optimizer = make(0)
    saver = Checkpointer(tmp_path, keep=2, asynchronous=True)
    good = saver.save(1, model, optimizer, META)
    monkeypatch.setattr(ckpt, "_storage_writer", FullDisk)
    saver.save(2, model, optimizer, META)  # waits for step 1's write and publishes it first
    assert find_latest(tmp_path) == good and saver.writing == "step_2"
    wait_futures([saver._write.future])  # the write has failed in the background
    with pytest.raises(CheckpointError, match=r"saving checkpoint step_2 failed \(.*No space left "
                       r"on device\); the previous checkpoint .*step_1 is intact"):
        saver.poll(3)  # what the next step calls
    assert saver.writing is None and find_latest(tmp_path) == good
    assert not (tmp_path / ".tmp-step_2").exists() and (tmp_path / "latest").read_text() == "step_1\n"


def test_resume_names_an_incomplete_checkpoint_it_skips(tmp_path):
    model, optimizer = make(0)
    good = Checkpointer(tmp_path, keep=2, asynchronous=False).save(4, model, optimizer, META)
    (tmp_path / ".tmp-step_8").mkdir()  # a run killed while it wrote step 8
    (tmp_path / ".tmp-step_8" / "__0_0.distcp").write_bytes(b"partial")
    path, notes = find_resumable(tmp_path)
    assert path == good
    assert notes == [f"checkpoint step_8 is incomplete (the run stopped while it was being "
                     f"written; only {tmp_path / '.tmp-step_8'} is there); skipping it"]


def test_the_progress_bar_says_which_checkpoint_is_being_written():
    record = {"loss": 3.0, "tokens_per_s": 1000.0, "tflops_per_gpu": 0.0, "mfu": None,
              "peak_mem_gib": 0.5}
    assert postfix(record, saving="step_4").endswith(", peak 0.50 GiB, saving step_4")
    assert postfix(record, 2.5, "step_4").startswith("loss 3.000, val 2.500, ")
    assert "saving" not in postfix(record)


# ------------------------------------------------------------------ two processes


def launch(corpus, out_dir, *extra, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), *ASYNC, "--data.path", str(corpus), "--train.out_dir", str(out_dir), *extra]
    return subprocess.run(cmd, env={**_env(), **(env or {})}, cwd=REPO, capture_output=True,
                          text=True, timeout=180)


def train(world, corpus, out_dir, *extra, env=None) -> str:
    """The run in the session's world of two ranks, its writes steered by ``env``; what rank 0
    printed."""
    from _async_ckpt_worker import steered_run

    argv = [*ASYNC, "--data.path", str(corpus), "--train.out_dir", str(out_dir), *extra]
    return world(2).run(steered_run, argv=argv, env=env or {})[0][1]


@pytest.fixture(scope="module")
def held_run(world, corpus, tmp_path_factory):
    """8 steps with async saves at 4 and 8; the write of step 4 is held until the loop has logged
    step 6, so it can only finish if training goes on meanwhile."""
    out = tmp_path_factory.mktemp("held")
    return out, train(world, corpus, out, env={"HOLD_WRITE": "4:6"})


def test_training_goes_on_while_a_checkpoint_is_written(held_run):
    out, printed = held_run
    for rank in (0, 1):
        held = json.loads((out / f"hold_rank{rank}.json").read_text())
        # Released by the loop's progress (two more steps logged), not by the give-up clock.
        assert held == {"save": 4, "steps_logged_while_held": held["steps_logged_while_held"],
                        "gave_up": False}
        assert held["steps_logged_while_held"] >= 6
    assert "checkpoints are written in the background" in printed
    # The write of step 4 ended after step 6 was logged, so steps 5-7 at least ran during it.
    saved = re.search(r"checkpoint step_4 saved: training waited [0-9.]+ s to stage it \(previous "
                      r"write [0-9.]+ s, copy [0-9.]+ s, planning [0-9.]+ s\), then it was written "
                      r"in the background in [0-9.]+ s, over steps 5-(\d+)", printed)
    assert saved and int(saved.group(1)) >= 7, printed
    assert (out / "checkpoints" / "latest").read_text() == "step_8\n"
    assert find_latest(out / "checkpoints").name == "step_8"
    assert damage(out / "checkpoints" / "step_4") is None
    assert sorted(loss_and_grad_norm(out)) == list(range(1, 9))


def test_resume_from_an_async_checkpoint_matches_the_uninterrupted_run_bit_for_bit(
        world, held_run, corpus, tmp_path):
    uninterrupted, _ = held_run
    resumed = stopped_copy(uninterrupted, 4, tmp_path / "resumed")
    assert "at step 4" in train(world, corpus, resumed, "--resume")
    expected = {s: v for s, v in loss_and_grad_norm(uninterrupted).items() if s > 4}
    assert loss_and_grad_norm(resumed) == expected  # exact float equality


def test_a_rank_killed_during_a_write_resumes_from_the_previous_checkpoint(world, held_run, corpus,
                                                                           tmp_path):
    out = tmp_path / "killed"
    # Rank 1 dies with its shards of step 8 on disk but the save unfinished.
    killed = launch(corpus, out, "--parallel.collective_timeout_s", "30",
                    env={"KILL_WRITE": "8:1"})
    assert killed.returncode != 0, killed.stdout + killed.stderr
    checkpoints = out / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step_4\n"
    assert (checkpoints / ".tmp-step_8").is_dir() and not (checkpoints / "step_8").exists()

    printed = train(world, corpus, out, "--resume")
    assert "checkpoint step_8 is incomplete (the run stopped while it was being written" in printed
    assert f"resumed from {checkpoints / 'step_4'} (the newest whole checkpoint) at step 4" in printed
    assert not (checkpoints / ".tmp-step_8").exists()  # the next save deleted the debris
    assert (checkpoints / "latest").read_text() == "step_8\n"
    uninterrupted = {s: v for s, v in loss_and_grad_norm(held_run[0]).items() if s > 4}
    resumed = {s: v for s, v in loss_and_grad_norm(out).items() if s > 4}
    assert resumed == uninterrupted


def test_auto_keeps_saves_synchronous_where_the_staging_would_pin_most_of_the_ram():
    """8b on one H200 host (128 GiB of RAM): 89.7 GiB of pinned staging per rank is over half the RAM,
    so `auto` writes synchronously and says why; 1b (16.7 GiB) stays asynchronous; eight 8b ranks
    on a 2 TiB node fit."""
    from mfsdp.train.checkpoint import async_staging_problem

    gib = 2 ** 30
    big = checkpoint_bytes(8_030_261_248)
    problem = async_staging_problem(big, 1, 128 * gib)
    assert problem is not None and "89.7 GiB of this node's 128.0 GiB" in problem, problem
    assert "--train.async_checkpoint true forces them" in problem
    assert async_staging_problem(checkpoint_bytes(1_498_482_688), 1, 128 * gib) is None
    assert async_staging_problem(big, 8, 2048 * gib) is None
    assert async_staging_problem(big, 8, 1024 * gib) is not None

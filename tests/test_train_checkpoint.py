"""Checkpoint atomicity and selection, on one process without a process group."""

import os

import pytest
import torch

from mfsdp.train.checkpoint import (CheckpointError, CheckpointMeta, check_compatible, find_latest,
                                    load_checkpoint, save_checkpoint)
from mfsdp.train.checkpoint import storage as ckpt

pytestmark = [pytest.mark.timeout(60),
              # DCP notes that it saves without a process group; that is the point here.
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

META = CheckpointMeta(model={"dim": 8})


def make(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_save_then_load_restores_model_and_optimizer(tmp_path):
    model, optimizer = make(0)
    path = save_checkpoint(tmp_path, 5, model, optimizer, META)
    assert find_latest(tmp_path) == path and (tmp_path / "latest").read_text() == "step_5\n"
    other, other_optimizer = make(1)
    assert load_checkpoint(path, other, other_optimizer).step == 5
    torch.testing.assert_close(other.weight, model.weight, rtol=0, atol=0)
    torch.testing.assert_close(other_optimizer.state_dict()["state"][0]["exp_avg"],
                               optimizer.state_dict()["state"][0]["exp_avg"], rtol=0, atol=0)


def test_a_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer = make(0)
    good = save_checkpoint(tmp_path, 1, model, optimizer, META)
    saved_weight = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)

    def crash(temp, final):  # the process dies after writing shards, before publishing
        raise SystemExit("killed")
    monkeypatch.setattr(ckpt, "_publish", crash)
    with pytest.raises(SystemExit):
        save_checkpoint(tmp_path, 2, model, optimizer, META)
    monkeypatch.undo()

    assert (tmp_path / ".tmp-step_2").is_dir()  # the debris of the interrupted save
    assert find_latest(tmp_path) == good
    fresh, fresh_optimizer = make(3)
    load_checkpoint(find_latest(tmp_path), fresh, fresh_optimizer)
    torch.testing.assert_close(fresh.weight, saved_weight, rtol=0, atol=0)
    # The next save clears the debris and publishes normally.
    assert save_checkpoint(tmp_path, 2, model, optimizer, META) == tmp_path / "step_2"
    assert not (tmp_path / ".tmp-step_2").exists() and find_latest(tmp_path).name == "step_2"


def test_latest_falls_back_to_the_newest_complete_directory_and_old_ones_are_pruned(tmp_path):
    model, optimizer = make(0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, optimizer, META, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_3"]
    os.remove(tmp_path / "latest")
    (tmp_path / "step_9").mkdir()  # incomplete: no metadata
    assert find_latest(tmp_path).name == "step_3"


def test_a_checkpoint_for_another_model_shape_is_refused(tmp_path):
    model, optimizer = make(0)
    path = save_checkpoint(tmp_path, 1, model, optimizer, CheckpointMeta(model={"dim": 8, "n_layers": 2}))
    check_compatible(path, {"dim": 8, "n_layers": 2})
    with pytest.raises(CheckpointError, match="different model .*n_layers: checkpoint 2, now 3"):
        check_compatible(path, {"dim": 8, "n_layers": 3})


def test_random_generators_resume_where_the_checkpoint_left_them(tmp_path):
    model, optimizer = make(0)
    path = save_checkpoint(tmp_path, 1, model, optimizer, META)
    expected = torch.rand(4)  # what the run draws next (dropout, say)
    torch.manual_seed(99)  # a resumed process starts from elsewhere
    load_checkpoint(path, *make(1))
    assert torch.equal(torch.rand(4), expected)


def test_a_checkpoint_without_generator_states_loads_and_leaves_them(tmp_path, monkeypatch):
    model, optimizer = make(0)
    monkeypatch.setattr(ckpt, "_rng_state", lambda: {})  # as written before they were saved
    path = save_checkpoint(tmp_path, 1, model, optimizer, META)
    monkeypatch.undo()
    torch.manual_seed(7)
    expected = torch.get_rng_state()
    other, other_optimizer = make(1)
    torch.set_rng_state(expected)
    load_checkpoint(path, other, other_optimizer)
    torch.testing.assert_close(other.weight, model.weight, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), expected)


def test_a_checkpoint_from_before_the_meta_format_resumes(tmp_path):
    """meta.json as mfsdp wrote it before ``format`` (a plain dict, no version) reads as format 0,
    its files are still checked, and it loads."""
    import json

    model, optimizer = make(0)
    path = save_checkpoint(tmp_path, 3, model, optimizer, META)
    record = json.loads((path / "meta.json").read_text())
    old = {k: v for k, v in record.items() if k in ("model", "data_seed", "world_size", "config", "step", "files")}
    (path / "meta.json").write_text(json.dumps(old))
    meta = CheckpointMeta.read(path)
    assert (meta.format, meta.step, meta.held_out, meta.files) == (0, 3, None, record["files"])
    assert find_latest(tmp_path) == path
    other, other_optimizer = make(1)
    assert load_checkpoint(path, other, other_optimizer).step == 3
    torch.testing.assert_close(other.weight, model.weight, rtol=0, atol=0)

"""The planner's side of optimizer offload: ``mfsdp plan`` and ``--parallel.offload auto``.

The offloaded estimate against the plain one (the states of exactly the chosen units leave every
phase; the host holds master, states, backup and a two-buffer ring), the search's order and its
smallest fitting fraction, and that it never answers "use more GPUs" while offload fits.
"""

from __future__ import annotations

import dataclasses

import pytest

from mfsdp.memory import plan
from mfsdp.memory.api import OffloadedEstimate
from mfsdp.memory.estimate import GIB
from mfsdp.train.command import plan as train_plan
from mfsdp.train.run.resolve import load_config

EIGHT_B = ["--model.preset", "8b", "--data.seq_len", "4096", "--data.local_batch", "1", "--data.microbatches", "4",
           "--parallel.activation_checkpointing", "true"]


@pytest.fixture(scope="module")
def cfg():
    """The planner's view of the config (``mfsdp.train.command.plan.planned_run``)."""
    return train_plan.planned_run(load_config(EIGHT_B))


def test_offloaded_estimate_moves_the_chosen_units_states_to_the_host(cfg):
    base = cfg.setting
    plain = plan.estimate_run(cfg, 1, base)
    half = plan.estimate_run(cfg, 1, dataclasses.replace(base, offload=0.5))
    assert isinstance(half, OffloadedEstimate) and not isinstance(plain, OffloadedEstimate)
    # 35 units: the head, 32 layers, the embedding, the root (the final norm); half rounded up, from
    # the head (its gradient finishes first), by the runtime's rule (mfsdp.offload.policy.units_to_offload)
    assert half.offloaded_units == ("output", *(f"layers.{i}" for i in range(31, 14, -1))), half.offloaded_units
    h = half.host_bytes
    assert h["states"] == 2 * h["master"] and h["backup"] == h["master"] + h["states"]
    for a, b in zip(plain.phases, half.phases):  # every phase, by exactly the states' bytes
        assert a.components["optimizer states"] - b.components["optimizer states"] == h["states"]
        assert {k: v for k, v in a.components.items() if k != "optimizer states"} == \
            {k: v for k, v in b.components.items() if k != "optimizer states"}
    assert plain.peak_bytes - half.peak_bytes == h["states"]
    assert h["staging"] == 2 * 128256 * 4096 * 4  # two of the largest offloaded unit: the head
    assert h["states"] == 8 * (128256 * 4096 + 17 * 218112000)  # 8 bytes x (the head + 17 layers)
    everything = plan.estimate_run(cfg, 1, dataclasses.replace(base, offload=1.0))
    assert everything.offloaded_units[-2:] == ("tok_embeddings", "") and len(everything.offloaded_units) == 35


def test_auto_takes_the_smallest_fraction_that_fits(cfg):
    base = cfg.setting
    need = {f: plan.estimate_run(cfg, 1, dataclasses.replace(base, offload=f)).device_bytes
            for f in (0.0, *plan.OFFLOAD_FRACTIONS)}
    assert all(need[a] > need[b] for a, b in zip(need, list(need)[1:]))  # more offload, less memory
    assert plan.offload_fraction_that_fits(cfg, 1, need[0.0]) == 0.0  # fits without: none
    assert plan.offload_fraction_that_fits(cfg, 1, need[0.5]) == 0.5
    assert plan.offload_fraction_that_fits(cfg, 1, (need[0.25] + need[0.5]) // 2) == 0.5
    assert plan.offload_fraction_that_fits(cfg, 1, need[1.0] - 1) is None


def test_the_search_offers_offload_before_more_gpus(cfg, capsys):
    base = cfg.setting
    gpu = plan.estimate_run(cfg, 1, dataclasses.replace(base, offload=0.75)).device_bytes
    fits = plan.fitting(cfg, 1, gpu)
    assert fits and all(s.offload for s, _ in fits)  # nothing fits on the GPU alone here
    assert all(e.fit(gpu) == "fits" for _, e in fits)
    layouts = [(s.placements, s.activation_checkpointing, s.local_batch) for s, _ in fits]
    assert len(layouts) == len(set(layouts))  # one (smallest) fraction per layout
    assert train_plan.main(EIGHT_B + ["--nproc-per-node", "1", "--gpu-memory", str(gpu), "--out", "/dev/null"]) == 0
    out = capsys.readouterr().out
    assert "use more GPUs" not in out and "--parallel.offload optimizer --parallel.offload_fraction" in out
    assert "host RAM:" in out and "CPU exposed per step" in out


def test_offload_ranks_by_its_predicted_exposed_host_step():
    """The search's order follows the costs measured on one H200 with 8B (session 4): without
    checkpointing or offload is fastest; at 16k tokens per step (4 microbatches) half the units
    offloaded is slower than checkpointing, a quarter at 64k (16 microbatches) faster; 5 of the 35
    units (0.174 of the parameters) at 16k took 1.840 s per step against 1.575 s, and 7 (0.228)
    1.998 s; with one microbatch of 4096 tokens offload ranks after checkpointing."""
    none, ac, half = (plan.Setting("zero3", a, 1, 4, "bf16", off, 16384) for a, off in
                      ((False, 0.0), (True, 0.0), (False, 0.5)))
    assert sorted([half, ac, none], key=plan.Setting.speed_key) == [none, ac, half]
    quarter, ac_64k = (plan.Setting("zero3", a, 1, 16, "bf16", off, 65536) for a, off in ((False, 0.25), (True, 0.0)))
    assert quarter.speed_key() < ac_64k.speed_key()
    small = plan.Setting("zero3", False, 1, 4, "bf16", 0.12, 16384)
    assert small.step_cost(0.174) == pytest.approx(1.840 / 1.575, abs=0.01)
    assert small.step_cost(0.228) == pytest.approx(1.998 / 1.575, abs=0.01)
    one = [plan.Setting("zero3", a, 1, 1, "bf16", off, 4096) for a, off in ((True, 0.0), (False, 0.25))]
    assert sorted(one[::-1], key=plan.Setting.speed_key) == one


def test_the_search_offloads_hugging_face_models_as_the_trainer_does(cfg):
    """A Hugging Face model (the manager's) can offload, as ``mfsdp train`` offloads it: the search
    offers the same fractions for it as for the bundled model."""
    hf = dataclasses.replace(cfg, model="some/hf_dir")
    assert hf.hf and not cfg.hf
    offered = {s.offload for s in plan.candidates(hf)}
    assert offered == {s.offload for s in plan.candidates(cfg)} == {0.0, *plan.OFFLOAD_FRACTIONS}

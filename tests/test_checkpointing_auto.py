"""``--parallel.activation_checkpointing auto`` and a count of checkpointed blocks: the runtime's rule
(the first blocks), its parity with none under sharding, the planner's accounting of k of n blocks,
and auto's choice (none when nothing is needed, else the fewest that fit), all on CPU."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from mfsdp.models.parallelize import ParallelizeConfig, checkpointed_blocks

GIB = 2 ** 30
ONE_B = ["--model.preset", "1b", "--data.seq_len", "8192", "--data.local_batch", "1"]


def test_the_checkpointed_blocks_are_the_first_ones():
    assert checkpointed_blocks(list("abcd"), True) == list("abcd") and checkpointed_blocks(list("abcd"), False) == []
    assert checkpointed_blocks(list("abcd"), 0) == [] and checkpointed_blocks(list("abcd"), 3) == list("abc")
    with pytest.raises(ValueError, match="has 4 blocks"):
        checkpointed_blocks(list("abcd"), 5)
    with pytest.raises(ValueError, match="activation_checkpointing must be"):
        ParallelizeConfig(activation_checkpointing=-1)


def sharded_grads(rank, ws, checkpointing):
    """Loss and gathered gradients of one fp32 backward of the tiny Llama (4 blocks), zero3 over ``ws``
    ranks, with ``checkpointing`` (ParallelizeConfig's) and the blocks that recompute."""
    from mfsdp.mesh import build_mesh
    from mfsdp.models import build_model, get_config
    from mfsdp.models.parallelize import parallelize

    with torch.device("meta"):
        model = build_model(get_config("tiny"), dtype=torch.float32)
    parallelize(model, build_mesh("cpu", ws), ParallelizeConfig("zero3", activation_checkpointing=checkpointing))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(rank))
    loss, count = model(tokens, labels=tokens)
    (loss / count).backward()
    return float(loss), {n: p.grad.full_tensor() for n, p in model.named_parameters()}, \
        [block.checkpointing for block in model.layers]


def test_checkpointing_some_blocks_gives_the_same_loss_and_gradients(world):
    """Two of four blocks recomputing: the loss and every gradient equal those without checkpointing
    (fp32, zero3 on two ranks), and the first two blocks are the ones that recompute."""
    none, some = (world(2).run(sharded_grads, checkpointing=k) for k in (False, 2))
    for (loss0, grads0, _), (loss2, grads2, flags) in zip(none, some):
        assert flags == [True, True, False, False], flags
        assert loss0 == loss2
        for name, grad in grads0.items():
            torch.testing.assert_close(grads2[name], grad, rtol=0, atol=1e-6, msg=name)


def test_the_planner_holds_k_blocks_inputs_and_the_rest_in_full():
    """k of n blocks checkpointed: the activations saved at the end of forward are the embedding's, k
    checkpointed blocks' and n - k full ones' (linear between none and all), and the peak falls with k."""
    from mfsdp.memory import estimate

    def saved(ac):
        e = estimate("1b", world_size=1, seq_len=2048, activation_checkpointing=ac)
        return e.component_max("activations (saved)"), e.peak_bytes

    (none, peak0), (every, peak16) = saved(False), saved(True)
    per_block = (none - every) // 16
    for k in (1, 5, 12):
        got, peak = saved(k)
        assert got == none - k * per_block, (k, got, none, every)
        assert peak16 <= peak <= peak0
    assert saved(0) == (none, peak0) and saved(16) == (every, peak16)


def _resolve(monkeypatch, args, memory_gib, world=1, device="cuda"):
    from mfsdp.train import preflight
    from mfsdp.train.args import load_config

    lines = []
    monkeypatch.setattr(preflight, "device_memory", lambda device: int(memory_gib * GIB))
    cfg = preflight.resolve_checkpointing(load_config(args), world, torch.device(device), lines.append)
    return cfg, lines


def test_auto_checkpoints_none_when_nothing_is_needed_and_the_fewest_that_fit_otherwise(monkeypatch):
    """1b at 8,192 tokens fits 40 GiB without checkpointing and 30 GiB only with some: auto takes none
    there and here the fewest blocks that fit (one fewer does not); "true" / "false" and a CPU run
    stay as they are; kept gathers are then chosen with those blocks checkpointed."""
    from mfsdp.memory.plan import estimate_run
    from mfsdp.train import preflight
    from mfsdp.train.plan import planned_run

    cfg, lines = _resolve(monkeypatch, ONE_B, 40)
    assert cfg.parallel.checkpointing() == 0
    assert lines == ["--parallel.activation_checkpointing auto: none of 16 blocks checkpointed (one GPU: the run "
                     "fits without)"], lines
    cfg, lines = _resolve(monkeypatch, ONE_B, 30)
    k = cfg.parallel.checkpointing()
    assert 0 < k < 16 and lines == [f"--parallel.activation_checkpointing auto: {k} of 16 blocks checkpointed "
                                    "(one GPU: the fewest that fit)"], lines
    run = planned_run(cfg)
    fits = lambda n: estimate_run(run, 1, dataclasses.replace(run.setting, activation_checkpointing=n)).fit(30 * GIB)  # noqa: E731
    assert fits(k) == "fits" and fits(k - 1 or False) != "fits"
    kept = preflight.resolve_kept_blocks(cfg, 1, torch.device("cuda"), lines.append).parallel.kept_blocks()
    assert estimate_run(dataclasses.replace(run, keep_gathered_blocks=kept), 1).fit(30 * GIB) == "fits"
    for given in ("true", "false", "3"):
        cfg, lines = _resolve(monkeypatch, [*ONE_B, "--parallel.activation_checkpointing", given], 30)
        assert cfg.parallel.activation_checkpointing == given and lines == []
    cfg, lines = _resolve(monkeypatch, ONE_B, 30, device="cpu")
    assert cfg.parallel.checkpointing() == 0 and lines[0].endswith("none of 16 blocks checkpointed (CPU run)")


def test_the_config_takes_auto_bools_and_counts(tmp_path):
    from mfsdp.train.args import load_config
    from mfsdp.train.config import ConfigError, ParallelSection
    from mfsdp.train.preflight import _resumed_checkpointing

    assert ParallelSection().activation_checkpointing == "auto" and ParallelSection().checkpointing() is False
    assert ParallelSection(activation_checkpointing=True).checkpointing() is True
    assert ParallelSection(activation_checkpointing=4).checkpointing() == 4
    yaml = tmp_path / "c.yaml"
    yaml.write_text("parallel:\n  activation_checkpointing: false\n")
    assert load_config(["--config", str(yaml)]).parallel.checkpointing() is False
    assert load_config(["--parallel.activation_checkpointing", "True"]).parallel.checkpointing() is True
    with pytest.raises(ConfigError, match="must be auto, true, false or a number"):
        load_config(["--parallel.activation_checkpointing", "some"])
    with pytest.raises(ConfigError, match="the model has 16 blocks"):
        load_config([*ONE_B, "--parallel.activation_checkpointing", "17"])
    # A resume keeps the count its checkpoint's run resolved auto to; a setting given stays.
    meta = types.SimpleNamespace(config={"parallel": {"activation_checkpointing": "7"}})
    assert _resumed_checkpointing(load_config(ONE_B), meta).parallel.checkpointing() == 7
    given = load_config([*ONE_B, "--parallel.activation_checkpointing", "false"])
    assert _resumed_checkpointing(given, meta).parallel.checkpointing() is False

"""``CommunicationPolicy.keep_gathered``: a module's gather serves every forward and backward of the
step and is made afresh once the weights change (CPU, gloo)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import mfsdp
from mfsdp.runtime import collectives
from models import Net, global_batch, loss_fn, make_mesh, make_placements, shard_net
from test_core_parity import _check, train_parity

KEEP = {"keep_gathered": True}


@pytest.mark.parametrize("kind,opt,mb", [("zero3", "adamw", 3), ("hfsdp", "sgd", 3)])
def test_parity_with_kept_gathers(world, kind, opt, mb):
    """Every module keeps its gather: each step's first forward must see the weights the last step
    wrote (a stale gather drifts from the reference after the first step)."""
    ws = 4 if kind == "hfsdp" else 2
    _check(world(ws).run(train_parity, kind=kind, opt=opt, mb=mb, comm=KEEP, steps=4))


def test_parity_with_kept_gathers_bound_and_double_buffered(world):
    """The bound optimizer gathers the first modules inside the step (``prefetch_across_step``); kept
    modules never take a double-buffer slot, which they would hold through the step."""
    _check(world(2).run(train_parity, kind="zero3", opt="adamw", mb=2, bind=True, steps=4,
                        comm={**KEEP, "double_buffer": True}))


def counted_gathers(rank, ws, mb, keep_blocks):
    """All-gathers of one step of ``mb`` microbatches and the next forward, where the last
    ``keep_blocks`` of three blocks keep their gathers; and what each module holds at the end."""
    torch.manual_seed(0)
    net = Net(n_blocks=3)
    mesh, placements = make_mesh("zero3", ws), make_placements("zero3")
    keep = mfsdp.CommunicationPolicy(keep_gathered=True)
    for i, block in enumerate(net.blocks):
        mfsdp.fully_shard(block, mesh, placements, communication_policy=keep if i >= 3 - keep_blocks else None)
    mfsdp.fully_shard(net, mesh, placements)
    optim = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = global_batch(0, 4 * ws, 5, 13)
    net(x[:1]).sum().backward()  # warm-up step, then count one step
    optim.step()
    optim.zero_grad()
    count = [0]
    original = collectives.all_gather

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    collectives.all_gather = counting
    try:
        for i, (mx, my) in enumerate(zip(x.chunk(mb), y.chunk(mb))):
            with mfsdp.microbatch(net, is_last=i == mb - 1):
                loss_fn(net(mx), my).backward()
        optim.step()
        with torch.no_grad():
            net(x[:1])
    finally:
        collectives.all_gather = original
    held = [all(g.unsharded.tensor.untyped_storage().nbytes() > 0 for g in b.parameter_groups) for b in net.blocks]
    return count[0], held


@pytest.mark.parametrize("keep_blocks", [0, 2, 3])
def test_a_kept_module_gathers_once_per_step(world, keep_blocks):
    """Root (gathered once per forward, kept into backward) + 3 blocks, 2 microbatches: a block gathers
    in every forward and backward, a kept one once per step; the next forward gathers every module
    once (the step changed the weights), and the kept blocks still hold their gathers after it."""
    mb = 2
    count, held = world(2).run(counted_gathers, mb=mb, keep_blocks=keep_blocks)[0]
    per_block = [1 if i >= 3 - keep_blocks else 2 * mb for i in range(3)]
    assert count == mb * 1 + sum(per_block) + 4, (count, per_block)
    assert held == [i >= 3 - keep_blocks for i in range(3)], held


def reload_is_seen(rank, ws):
    """A kept gather is dropped when a state dict is loaded into the module (no optimizer step)."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    net = shard_net(Net(n_blocks=2), make_mesh("zero3", ws), make_placements("zero3"),
                    comm=mfsdp.CommunicationPolicy(keep_gathered=True))
    other = Net(n_blocks=2)  # other weights (the seed moved on), the same on every rank
    x, _ = global_batch(0, 2, 5, 13)
    with torch.no_grad():
        before = net(x)  # every module gathers and keeps
        net.load_state_dict({k: distribute_tensor(other.state_dict()[k], v.device_mesh, v.placements)
                             for k, v in net.state_dict().items()})
        got, expected = net(x), other(x)
    assert float((before - expected).abs().max()) > 1e-3  # the load changes the output
    return float((got - expected).abs().max())


def test_a_load_drops_the_kept_gathers(world):
    assert max(world(2).run(reload_is_seen)) < 1e-6


def test_the_kept_blocks_are_the_last_ones():
    from mfsdp.models.parallelize import ParallelizeConfig, kept_blocks

    assert kept_blocks(list("abcd"), 0) == [] and kept_blocks(list("abcd"), 3) == list("bcd")
    with pytest.raises(ValueError, match="has 4 blocks"):
        kept_blocks(list("abcd"), 5)
    with pytest.raises(ValueError, match="keep_gathered_blocks"):
        ParallelizeConfig(keep_gathered_blocks=-1)


def float8_parity(rank, ws, device="cpu"):
    """FP8 all-gather with every module keeping its gather: torchao's unsharded model alike."""
    import test_float8 as f8

    net = f8.make_net("tensorwise").to(device)
    ref = copy.deepcopy(net)
    f8.shard(net, ws, fp8_gather=True, device=device, comm=mfsdp.CommunicationPolicy(keep_gathered=True))
    return f8.train_and_compare(rank, ws, net, ref, precompute=False, steps=4, device=device)


@pytest.mark.parametrize("ws", [1, 2])
def test_float8_weights_encoded_once_per_step(world, ws):
    """One gather, so one encode (and one amax reduction), per block per step instead of two; on one
    rank the gather is the encode itself (``mfsdp train`` on one GPU)."""
    pytest.importorskip("torchao")
    from test_float8 import BLOCKS

    reductions = world(ws).run(float8_parity)[0]
    assert reductions == [BLOCKS] * 4, reductions


def kept_buffers(rank, ws, keep):
    """The gather buffers a real tiny Llama keeps through a step on one rank (bf16 compute)."""
    from mfsdp.mesh import build_mesh
    from mfsdp.models import build_model, get_config
    from mfsdp.models.parallelize import ParallelizeConfig, parallelize

    with torch.device("meta"):
        model = build_model(get_config("tiny"), dtype=torch.bfloat16)
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32)
    parallelize(model, build_mesh("cpu", ws), ParallelizeConfig(mixed_precision=policy, keep_gathered_blocks=keep))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    model(torch.zeros(1, 8, dtype=torch.long)).float().sum().backward()
    return sum(g.unsharded.tensor.untyped_storage().nbytes() for b in model.layers for g in b.parameter_groups)


def test_the_planner_counts_the_kept_gathers_as_the_runtime_keeps_them(world):
    """``keep_gathered_blocks`` adds the kept blocks' gather buffers to every phase, to the byte of what
    the runtime holds after a step, and never more than that to the peak."""
    from mfsdp.memory import estimate

    kept = world(1).run(kept_buffers, keep=2)[0]
    assert kept > 0 and world(1).run(kept_buffers, keep=0)[0] == 0
    base = estimate("tiny", world_size=1, seq_len=64, microbatches=2, device="cpu")
    keep = estimate("tiny", world_size=1, seq_len=64, microbatches=2, device="cpu", keep_gathered_blocks=2)
    assert all(p.components["unsharded (kept)"] == kept for p in keep.phases)
    assert 0 < keep.peak_bytes - base.peak_bytes <= kept


def test_mfsdp_train_keeps_gathers_with_the_same_losses(world, tmp_path):
    """``--parallel.keep_gathered_blocks``: the same run, bit for bit, with the last block's gathers kept
    through each step of two microbatches (two ranks); a count above the model's blocks is refused."""
    from mfsdp.data import prepare
    from mfsdp.data.prepare import stdlib_source
    from mfsdp.train.run.config import ConfigError
    from mfsdp.train.run.resolve import load_config
    from test_eval_loss import SMALL, run_trainer

    corpus = tmp_path / "small.tokens"
    prepare(stdlib_source(), corpus, glob="a*.py")
    args = [*SMALL, "--data.path", str(corpus), "--train.steps", "3", "--data.microbatches", "2",
            "--train.eval_every", "0"]
    runs = [world(2).run(run_trainer, argv=[*args, "--train.out_dir", str(tmp_path / f"k{k}"),
                                            "--parallel.keep_gathered_blocks", str(k)])[0] for k in (0, 1)]
    losses = [[r["loss"] for r in records] for records in runs]
    assert len(losses[0]) == 3 and losses[0] == losses[1], losses
    with pytest.raises(ConfigError, match="the model has 2 blocks"):
        load_config([*SMALL, "--parallel.keep_gathered_blocks", "3"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float8_kept_gathers_on_cuda(cuda_world):
    """The one-GPU FP8 path of ``mfsdp train --parallel.keep_gathered_blocks``: encoded once per step."""
    pytest.importorskip("torchao")
    from test_float8 import BLOCKS

    assert cuda_world.run(float8_parity, device="cuda")[0] == [BLOCKS] * 4


def test_auto_keeps_what_fits_on_one_gpu_and_nothing_elsewhere(monkeypatch):
    """``--parallel.keep_gathered_blocks auto`` (the default): on one GPU the most blocks with which the
    planner still fits the run in the allocator's margin (more memory, fewer; one more does not fit);
    on several GPUs, on CPU and for a number given, the setting stays as given (auto: none)."""
    from mfsdp.memory.plan import estimate_run
    from mfsdp.train.run import preflight
    from mfsdp.train.run.config import ConfigError
    from mfsdp.train.run.resolve import load_config
    from mfsdp.train.command.plan import planned_run

    args = ["--model.preset", "8b", "--data.seq_len", "4096", "--data.local_batch", "1", "--data.microbatches", "4"]
    cfg = load_config(args)
    assert cfg.parallel.keep_gathered_blocks == "auto" and cfg.parallel.kept_blocks() == 0
    lines = []
    cuda, gib = torch.device("cuda"), 2 ** 30

    def resolve(memory_gib, world=1, given=cfg):
        monkeypatch.setattr(preflight, "device_memory", lambda device: int(memory_gib * gib))
        return preflight.resolve_kept_blocks(given, world, cuda, lines.append).parallel.kept_blocks()

    small, large = resolve(139.8), resolve(160)
    assert 0 < small < large == 32, (small, large)
    run = planned_run(cfg)
    fits = lambda n: estimate_run(dataclasses.replace(run, keep_gathered_blocks=n), 1).fit(int(139.8 * gib))  # noqa: E731
    assert fits(small) == "fits" and fits(small + 1) != "fits"
    assert f"the last {small} of 32 blocks keep their gathers" in lines[0], lines
    assert resolve(139.8, world=8) == 0 and resolve(160, given=load_config([*args, "--parallel.keep_gathered_blocks", "3"])) == 3
    assert preflight.resolve_kept_blocks(cfg, 1, torch.device("cpu"), print).parallel.kept_blocks() == 0
    with pytest.raises(ConfigError, match="must be auto or a number"):
        load_config(["--parallel.keep_gathered_blocks", "many"])

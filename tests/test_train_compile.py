"""`mfsdp train --parallel.compile`: compiled blocks (inductor on CPU, tiny shapes) train the numbers
of the eager run, with activation checkpointing, a mixture of experts and a Hugging Face model; and
float8 without compile is refused where it would be slow (CUDA)."""

from __future__ import annotations

import concurrent.futures

import pytest

from _dist import World
from test_eval_loss import run_trainer
from test_train_e2e import SMALL, corpus  # noqa: F401  (the token file fixture)
from mfsdp.train.run.preflight import check_run
from mfsdp.train.run.config import ConfigError
from mfsdp.train.run.resolve import load_config

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore::UserWarning")]
COMPILE_NOTE = "including torch.compile of the blocks"
RUN = ["--train.steps", "3", "--train.checkpoint_every", "0", "--train.sample_tokens", "0", "--train.eval_every", "0"]


@pytest.fixture(scope="module")
def compiled_world():
    """One process of its own for the module's compiled runs (a fork of the worlds' forkserver): a
    compile changes process-wide state (dynamo's caches, inductor's config and its compile workers)
    that must not reach the shared worlds. Its runs share one import of torch and mfsdp and one
    warm-up of inductor, each after ``torch.compiler.reset()``, where each had a fresh interpreter."""
    w = World(1)
    yield w
    w.close()


def compiled_run(rank, world_size, argv):
    """``run_trainer`` after ``torch.compiler.reset()``: no graph or guard of an earlier run of this
    process is reused."""
    import torch

    torch.compiler.reset()
    return run_trainer(rank, world_size, argv, stdout=True)


def eager_and_compiled(world, compiled_world, tmp_path, *args):
    """The eager run in the shared world of one process, the compiled one in ``compiled_world`` at
    the same time (the trainer as ``mfsdp train`` runs it in both), so that the compile on one core
    overlaps the eager training on the other."""
    def argv(name, compile_flag):
        return ["--train.out_dir", str(tmp_path / name), *RUN, *args, "--parallel.compile", compile_flag]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(compiled_world.run, compiled_run, timeout=500, argv=argv("compiled", "true"))
        records, eager_out = world(1).run(run_trainer, stdout=True, argv=argv("eager", "auto"))[0]  # auto: off on CPU
        compiled_records, out = pending.result()[0]
    eager = {r["step"]: r["loss"] for r in records}
    compiled = {r["step"]: r["loss"] for r in compiled_records}
    assert COMPILE_NOTE in out and COMPILE_NOTE not in eager_out, out
    return eager, compiled


def assert_close(eager: dict, compiled: dict, steps, rel: float = 1e-4) -> None:
    assert sorted(compiled) == sorted(eager) == [1, 2, 3], (eager, compiled)
    for step in steps:
        assert abs(compiled[step] - eager[step]) <= rel * abs(eager[step]), (step, eager, compiled)


def test_compiled_blocks_train_the_eager_losses_with_checkpointing(world, compiled_world, corpus, tmp_path):
    eager, compiled = eager_and_compiled(world, compiled_world, tmp_path, *SMALL, "--data.path", str(corpus),
                                         "--parallel.activation_checkpointing", "true")
    assert eager[3] < eager[1]  # it trains
    assert_close(eager, compiled, (1, 2, 3))


def test_compiled_mixture_of_experts(world, compiled_world, corpus, tmp_path):
    """moe-tiny with each expert its own unit: routing is data-dependent (graph breaks, dynamic
    shapes), the losses still match; from step 2 on a near-tie in the router may route differently
    after the fp32 reordering of a compiled step, so only the first step's is held to 1e-4."""
    args = ["--model.preset", "moe-tiny", "--data.path", str(corpus), "--data.seq_len", "32", "--data.local_batch", "2",
            "--parallel.expert_units", "true", "--train.progress", "false", "--train.device", "cpu"]
    eager, compiled = eager_and_compiled(world, compiled_world, tmp_path, *args)
    assert_close(eager, compiled, (1,))
    assert_close(eager, compiled, (2, 3), rel=1e-2)


def test_compiled_hugging_face_model(world, compiled_world, corpus, tmp_path):
    pytest.importorskip("transformers")
    from test_manager_models import make_hf

    hf = tmp_path / "tiny-llama"
    make_hf("llama", vocab=260).save_pretrained(hf)
    eager, compiled = eager_and_compiled(world, compiled_world, tmp_path, "--model.hf", str(hf), "--model.hf_impl", "manager",
                                         "--data.path", str(corpus),
                                         "--data.seq_len", "16", "--data.local_batch", "2",
                                         "--train.progress", "false", "--train.device", "cpu")
    assert_close(eager, compiled, (1, 2, 3))


def test_float8_without_compile_is_refused_on_cuda_only():
    off = load_config(["--model.float8", "rowwise", "--parallel.compile", "false"])
    with pytest.raises(ConfigError, match=r"--parallel.compile false runs torchao's float8 casts eagerly.*"
                                          r"--parallel.compile auto"):
        check_run(off, 1, device_type="cuda")
    check_run(off, 1, device_type="cpu")  # eager float8 stays allowed on CPU (the tests)
    auto = load_config(["--model.float8", "tensorwise"])
    assert auto.compiles("cuda") and not auto.compiles("cpu")
    check_run(auto, 1, device_type="cuda")
    assert load_config(["--parallel.compile", "true"]).compiles("cpu")
    with pytest.raises(ConfigError, match="parallel.compile must be one of auto, true, false"):
        load_config(["--parallel.compile", "yes"])


def test_plan_predicts_compiled_blocks_from_the_measured_share():
    """A GPU run compiles (auto), and the plan says how it predicts compiled blocks: a dense Llama's
    without checkpointing save COMPILED_BLOCK_SAVED of the eager activations (and the compiled head
    loss holds bf16 logits), which puts 1b at 2 x 4096 above the 29.25 GiB measured compiled on one
    H200; with checkpointing (block inputs only) the blocks change nothing."""
    from mfsdp.memory.api import COMPILED_BLOCK_SAVED, COMPILED_NOTE
    from mfsdp.memory.estimate import GIB
    from mfsdp.memory.plan import estimate_run as planner_estimate
    from mfsdp.train.command.plan import planned_run

    def estimate_run(cfg, world):
        return planner_estimate(planned_run(cfg), world)

    assert COMPILED_NOTE in estimate_run(load_config([]), 1).notes  # auto: a GPU run compiles
    assert COMPILED_NOTE not in estimate_run(load_config(["--parallel.compile", "false"]), 1).notes
    one_b = ["--model.preset", "1b", "--data.local_batch", "2", "--data.seq_len", "4096",
             "--parallel.main_grads_dtype", "fp32"]
    eager, compiled = (estimate_run(load_config(one_b + ["--parallel.compile", c]), 1) for c in ("false", "true"))
    saved = [e.component_max("activations (saved)") for e in (eager, compiled)]
    assert COMPILED_BLOCK_SAVED <= saved[1] / saved[0] < COMPILED_BLOCK_SAVED + 0.005  # the embedding's are kept
    # Measured on one H200 with the blocks and the head loss compiled: 29.25 GiB
    # (benchmarks/results/2026-12-02_h200x1_session8, call 2). The plan stays above it.
    assert 29.25 <= compiled.peak_bytes / GIB <= 29.25 * 1.07, compiled.peak_bytes / GIB
    with_ac = ["--parallel.activation_checkpointing", "true"]
    ac = [estimate_run(load_config(one_b + with_ac + ["--parallel.compile", c]), 1) for c in ("true", "false")]
    assert ac[0].component_max("activations (saved)") == ac[1].component_max("activations (saved)")
    assert ac[0].peak_bytes < ac[1].peak_bytes  # the compiled head loss alone

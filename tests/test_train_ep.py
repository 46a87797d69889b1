"""`mfsdp train --parallel.ep N`: expert parallelism end to end on four CPU ranks.

The same data gives the same losses at ep 1, 2 and 4 on four ranks and in one process (fp32, the
load-balancing loss off: it is a per-rank mean, so it would differ between one process and four);
a run saved at ep 2 resumes at ep 4 and at ep 1 as if uninterrupted (the experts' DTensors reshard
across ep). The gradient norm is exact over gradients on two meshes (the dense mesh and the
experts'). Bad values of --parallel.ep are one error line, exit code 2.
"""

import shutil

import pytest
import torch

from test_eval_loss import run_trainer
from test_train_e2e import _one_error_line, corpus, in_process  # noqa: F401
from mfsdp.train.command.errors import ConfigError
from mfsdp.train.run.resolve import check_expert_parallel, load_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::UserWarning")]

MOE = ["--model.preset", "moe-tiny", "--model.n_layers", "2", "--model.dim", "64", "--model.ffn_dim", "128",
       "--model.moe_aux_loss_coef", "0", "--data.seq_len", "16", "--train.lr", "1e-2", "--train.warmup_steps", "1",
       "--train.progress", "false", "--train.device", "cpu", "--train.sample_tokens", "0",
       "--train.eval_every", "0", "--parallel.compute_dtype", "fp32"]
STEPS = ["--train.steps", "4", "--train.checkpoint_every", "2", "--train.keep_checkpoints", "0"]


def train(world, n: int, corpus, out, *args) -> tuple[list[dict], str]:
    """``n`` CPU ranks, one global batch of 8 windows; metrics.jsonl's records and rank 0's output."""
    batch = ["--data.local_batch", str(8 // n)]
    return world(n).run(run_trainer, timeout=240, argv=[*MOE, *batch, "--data.path", str(corpus),
                                                       "--train.out_dir", str(out), *args], stdout=True)[0]


def losses(rows) -> list[float]:
    return [r["loss"] for r in rows]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def one_process(world, corpus, tmp_path_factory) -> list[float]:
    rows, printed = train(world, 1, corpus, tmp_path_factory.mktemp("ep") / "one", *STEPS)
    assert "experts: 4 per layer, 4 on each of 1 ep ranks, each sharded 1 ways" in printed
    return losses(rows)


def test_ep_2_on_four_ranks_gives_the_one_process_losses(world, corpus, tmp_path, one_process):
    rows, printed = train(world, 4, corpus, tmp_path, *STEPS, "--parallel.ep", "2")
    assert "experts: 4 per layer, 2 on each of 2 ep ranks, each sharded 2 ways" in printed
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert close(losses(rows), one_process), (losses(rows), one_process)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 4])
def test_ep_1_and_4_on_four_ranks_give_the_one_process_losses(world, corpus, tmp_path, one_process, ep):
    """The default cell checks ep 2; these the other splits of four ranks."""
    rows, _ = train(world, 4, corpus, tmp_path, *STEPS, "--parallel.ep", str(ep))
    assert close(losses(rows), one_process), (ep, losses(rows), one_process)


def _resumed(world, corpus, tmp_path, whole_dir, ep: int) -> list[float]:
    """``whole_dir``'s run cut after its step-2 checkpoint, resumed on four ranks at ``ep``."""
    out = tmp_path / f"resumed_ep{ep}"
    shutil.copytree(whole_dir, out)
    shutil.rmtree(out / "checkpoints" / "step_4")
    (out / "checkpoints" / "latest").write_text("step_2\n")
    rows, _ = train(world, 4, corpus, out, *STEPS, "--parallel.ep", str(ep), "--resume")
    return losses(rows)


@pytest.fixture(scope="module")
def saved_at_ep_2(world, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep") / "whole"
    rows, _ = train(world, 4, corpus, out, *STEPS, "--parallel.ep", "2")
    return out, losses(rows)


def test_a_run_saved_at_ep_2_resumes_at_ep_4(world, corpus, tmp_path, saved_at_ep_2):
    whole_dir, whole = saved_at_ep_2
    resumed = _resumed(world, corpus, tmp_path, whole_dir, 4)
    assert close(resumed, whole), (resumed, whole)


@pytest.mark.slow
def test_a_run_saved_at_ep_2_resumes_at_ep_1(world, corpus, tmp_path, saved_at_ep_2):
    """The default cell resumes at ep 4; this one gathers the experts back onto every rank."""
    whole_dir, whole = saved_at_ep_2
    resumed = _resumed(world, corpus, tmp_path, whole_dir, 1)
    assert close(resumed, whole), (resumed, whole)


@pytest.fixture(scope="module")
def aux_on_at_ep_1(world, corpus, tmp_path_factory):
    rows, _ = train(world, 4, corpus, tmp_path_factory.mktemp("ep") / "aux1", *STEPS,
                    "--model.moe_aux_loss_coef", "0.05")
    return rows


@pytest.mark.parametrize("ep", [4, pytest.param(2, marks=pytest.mark.slow)])
def test_the_load_balancing_loss_is_the_same_at_every_ep(world, corpus, tmp_path, aux_on_at_ep_1, ep):
    """On the same four ranks the bundled presets' load-balancing loss (each rank's own tokens' routing)
    and so the losses agree at ep 1, 2 and 4."""
    rows, _ = train(world, 4, corpus, tmp_path, *STEPS, "--model.moe_aux_loss_coef", "0.05", "--parallel.ep", str(ep))
    for key in ("loss", "aux_loss"):
        got, want = [r[key] for r in rows], [r[key] for r in aux_on_at_ep_1]
        assert close(got, want), (key, got, want)


def test_lora_with_ep_adapts_the_dense_linears(world, corpus, tmp_path):
    """LoRA on a mixture of experts with the experts split: the attention linears adapted, the experts
    frozen; the same losses as the same LoRA run at ep 1."""
    lora = ["--peft.method", "lora", "--train.steps", "3", "--train.checkpoint_every", "0"]
    at_1, _ = train(world, 2, corpus, tmp_path / "ep1", *lora)
    at_2, printed = train(world, 2, corpus, tmp_path / "ep2", *lora, "--parallel.ep", "2")
    assert "experts: 4 per layer, 2 on each of 2 ep ranks" in printed and "4 linears" in printed, printed
    assert close(losses(at_2), losses(at_1)), (losses(at_2), losses(at_1))


def test_flat_adamw_with_ep_gives_the_ep_1_losses(world, corpus, tmp_path):
    """The flat AdamW step (``mfsdp train``'s default on CUDA) over experts split across ranks."""
    flat = ["--train.adamw_kernel", "flat", "--train.steps", "3", "--train.checkpoint_every", "0"]
    at_1, _ = train(world, 2, corpus, tmp_path / "ep1", *flat)
    at_2, _ = train(world, 2, corpus, tmp_path / "ep2", *flat, "--parallel.ep", "2")
    assert close(losses(at_2), losses(at_1)), (losses(at_2), losses(at_1))


# ------------------------------------------------------------------------------------- the checks
def test_ep_errors_are_one_line_each():
    def problem(world, *args, tp=1):
        with pytest.raises(ConfigError) as err:
            check_expert_parallel(load_config(list(args)), world, tp)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert "must divide the 3 data-parallel shard ranks" in problem(3, "--model.preset", "moe-tiny", "--parallel.ep", "2")
    assert "must divide the model's 4 experts" in problem(8, "--model.preset", "moe-tiny", "--parallel.ep", "8")
    assert "this model has none" in problem(4, "--model.preset", "tiny", "--parallel.ep", "2")
    assert "with tensor parallelism (--tp 2)" in problem(8, "--model.preset", "moe-tiny", "--parallel.ep", "2", tp=2)
    # hsdp: the shard is the world over the replicas.
    replicas = ["--parallel.placements", "hsdp", "--parallel.replicate", "2"]
    assert "must divide the 2 data-parallel shard ranks" in problem(4, "--model.preset", "moe-tiny", *replicas,
                                                                     "--parallel.ep", "4")
    check_expert_parallel(load_config(["--model.preset", "moe-tiny", *replicas, "--parallel.ep", "2"]), 4)
    with pytest.raises(ConfigError, match="--parallel.ep must be a positive integer, got 0"):
        load_config(["--model.preset", "moe-tiny", "--parallel.ep", "0"])


def test_ep_in_yaml_and_its_help(tmp_path):
    from mfsdp.train.command.args import usage

    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: moe-tiny\nparallel:\n  ep: 2\n")
    cfg = load_config(["--config", str(path)])
    assert cfg.parallel.ep == 2 and cfg.experts_line(4) == "experts: 4 per layer, 2 on each of 2 ep ranks, each sharded 2 ways"
    assert load_config(["--model.preset", "moe-tiny"]).parallel.ep == 1
    text = " ".join(usage().split())
    assert "--parallel.ep (1) Expert parallelism" in text and "every layer's experts module is its own unit" in text


def test_ep_on_a_dense_model_is_one_error_line(tmp_path, capsys):
    run = in_process(capsys, "--parallel.ep", "2", "--train.out_dir", str(tmp_path), "--train.device", "cpu")
    assert run.returncode == 2
    _one_error_line(run, "--parallel.ep 2 splits experts, but this model has none")


def test_the_experts_of_hugging_face_configs_are_counted():
    from mfsdp.train.run.config import ResolvedModel

    shape = load_config(["--model.preset", "tiny"]).resolved.shape
    qwen2 = ResolvedModel(shape, 0, hf_config={"num_experts": 60, "shared_expert_intermediate_size": 8})
    mixtral = ResolvedModel(shape, 0, hf_config={"num_local_experts": 8})
    assert (qwen2.num_experts, qwen2.shared_expert, mixtral.num_experts, mixtral.shared_expert) == (
        60, "shared_expert", 8, None)


# --------------------------------------------------------------------------------- the gradient norm
def two_mesh_norm(rank, world_size):
    """Gradients on a 1-D dense mesh and on a 2-D experts mesh ([ep_shard, ep]): the global norm and
    the clipped gradients against the unsharded ones."""
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from mfsdp.train.loop.step import clip_gradients

    torch.manual_seed(0)
    dense = DeviceMesh("cpu", torch.arange(world_size), mesh_dim_names=("dp",))
    experts = DeviceMesh("cpu", torch.arange(world_size).reshape(world_size // 2, 2),
                         mesh_dim_names=("ep_shard", "ep"))
    full = {"w": (torch.randn(6, 5), dense, [Shard(0)]), "b": (torch.randn(7), dense, [Shard(0)]),
            "gate_up": (3 * torch.randn(4, 6, 3), experts, [Shard(1), Shard(0)])}
    model = nn.Module()
    for name, (grad, mesh, placements) in full.items():
        param = nn.Parameter(distribute_tensor(torch.zeros_like(grad), mesh, placements))
        param.grad = distribute_tensor(grad.clone(), mesh, placements)
        model.register_parameter(name, param)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g, _, _ in full.values()]))
    norm = clip_gradients(model, float(expected) / 2)
    clipped = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return float(norm), float(expected), {n: float((clipped[n] - 0.5 * g).abs().max()) for n, (g, _, _) in full.items()}


def test_the_gradient_norm_over_two_meshes_is_the_unsharded_one(world):
    for norm, expected, errors in world(4).run(two_mesh_norm):
        assert abs(norm - expected) <= 1e-6 * expected, (norm, expected)
        assert max(errors.values()) < 1e-5, errors  # every gradient scaled by grad_clip / norm = 1/2

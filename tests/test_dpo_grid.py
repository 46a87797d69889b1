"""DPO against trl 1.16 across the grid of issue 52's Numerics: 1, 2 and 4 ranks, zero3 and ddp, the
bundled route (a Hugging Face directory run as the bundled Llama, packed pairs) and the manager's
(Hugging Face's modeling code, padded pairs), full fine-tuning and LoRA, tiny Llama and Qwen2
directories. Each cell builds the model as ``mfsdp train`` does (``build``) and runs one step's
forward and backward of the Preference objective; trl's ``_compute_loss`` runs on the same
directory's ``transformers`` model, unsharded. Compared with ``assert_parity``: the chosen and
rejected log-probs of every pair, the loss, every trainable gradient. CPU, fp32, gloo."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from mfsdp.data import PairWindows, TokenFile
from mfsdp.models.llama import local_block
from mfsdp.train.objectives.preference import Preference, pair_logps
from test_dpo_train import _pairs, _reference, _trl, assert_parity, padded_logps

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SEQ, PAIRS = 32, 16
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A tiny Llama and a tiny Qwen2 directory (fp32 safetensors), ids of the pair files below vocab."""
    from test_manager_models import make_hf

    root = tmp_path_factory.mktemp("hf")
    for family in ("llama", "qwen2"):
        make_hf(family, vocab=96, seed=7).save_pretrained(root / family)
    return root


def _argv(hf_dir, route, peft, placement, pairs, out):
    return ["--model.hf", str(hf_dir), "--model.hf_impl", route, "--data.path", str(pairs), "--data.seq_len",
            str(SEQ), "--train.device", "cpu", "--parallel.placements", placement, "--train.out_dir", str(out),
            "--dpo.beta", "0.3", *(["--peft.method", "lora", "--peft.lora_r", "2", "--peft.lora_alpha", "4"] if peft == "lora" else [])]


@torch.no_grad()
def draw_adapters(model, seed=5):
    """Every adapter's A and B drawn (whole, keyed by its Hugging Face name; then this rank's block):
    alike on both routes (``init_adapters`` keys A by the module's own name), and B not zero, so
    that the policy is not the base."""
    from mfsdp.hf.names import hf_module_name
    from mfsdp.hf.sharded import refresh_compute_weights
    from mfsdp.transforms.lora import lora_linears

    for name, linear in lora_linears(model):
        for i, weight in enumerate((linear.lora_A, linear.lora_B)):
            local, offset, shape = local_block(weight)
            generator = torch.Generator().manual_seed(seed + i + zlib.crc32(hf_module_name(name).encode()))
            whole = torch.randn(tuple(weight.shape), generator=generator) * 0.3
            local.view(shape).copy_(whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
    refresh_compute_weights(model)


def dpo_step(rank, world_size, argv, reference):
    """One step's forward and backward on this rank's share of the pair windows, scaled as
    ``train_step`` scales it; this rank's pairs and their log-probs, the loss sum, and (rank 0) the
    whole gradients by Hugging Face name."""
    from mfsdp.hf.names import hf_module_name, hf_weight_names
    from mfsdp.train.build.model import build
    from mfsdp.train.run.resolve import load_config

    cfg = load_config(argv)
    model, _ = build(cfg, CPU, world_size, lambda _: None)
    if cfg.peft.lora:
        draw_adapters(model)
    data = TokenFile(cfg.data.path)
    objective = Preference(cfg, data)
    if objective.stored is not None:
        objective.stored.table = reference
    windows = PairWindows(data, SEQ, packed=not cfg.model.uses_manager)
    slots = range(rank, math.ceil(len(windows) / world_size) * world_size, world_size)
    batch = windows.batch([w if w < len(windows) else None for w in slots])
    loss, _, _ = objective(model, batch, CPU)
    (loss * world_size / int(windows.counted.sum())).backward()
    with torch.no_grad():
        logps = pair_logps(model, batch, CPU)
    grads = {n: (q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad)
             for n, q in model.named_parameters() if q.requires_grad}
    if not cfg.model.uses_manager:  # the bundled names -> Hugging Face's
        names = {mine: theirs for theirs, mine in hf_weight_names(cfg.resolved.shape)}
        grads = {names.get(n) or ".".join((hf_module_name(n.rpartition(".")[0]), n.rpartition(".")[2])): g
                 for n, g in grads.items()}
    return batch.pair_ids, logps.chosen, logps.rejected, loss.detach(), grads if rank == 0 else None


def _trl_side(hf_dir, argv, data, ids, reference):
    """trl's loss, metrics and gradients on the directory's unsharded ``transformers`` model (LoRA: our
    adapters with the same values, ``draw_adapters``; the reference the base, adapters off), and its per-pair log-probs."""
    from mfsdp.train.build.adapters import lora_transform
    from mfsdp.train.run.resolve import load_config
    from mfsdp.transforms.lora import adapters_off

    cfg = load_config(argv)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.config.use_cache = False
    if cfg.peft.lora:
        lora_transform(cfg.peft).apply(model)
        draw_adapters(model)
        with torch.no_grad(), adapters_off(model):
            reference = torch.zeros(data.num_samples, 2)
            reference[ids] = torch.stack(padded_logps(model, data, ids), 1)
    with torch.no_grad():
        logps = padded_logps(model, data, ids)
    value, metrics = _trl(model, data, ids, reference, "sigmoid", beta=0.3)
    value.backward()
    return logps, value, metrics, {n: q.grad for n, q in model.named_parameters() if q.requires_grad}


CELLS = [  # (route, family, peft, ranks, placement); the first two run in `make test`
    ("bundled", "qwen2", "full", 2, "ddp"), ("manager", "llama", "lora", 2, "zero3"),
    *[pytest.param(*cell, marks=pytest.mark.slow) for cell in [
        *[(route, family, peft, 2, placement) for route in ("bundled", "manager") for family in ("llama", "qwen2")
          for peft in ("full", "lora") for placement in ("zero3", "ddp")
          if (route, family, peft, placement) not in {("bundled", "qwen2", "full", "ddp"),
                                                      ("manager", "llama", "lora", "zero3")}],
        *[(route, "llama", peft, ranks, "zero3") for ranks in (1, 4) for route in ("bundled", "manager")
          for peft in ("full", "lora")]]]]


@pytest.mark.parametrize("route,family,peft,ranks,placement", CELLS)
def test_one_dpo_step_matches_trl(world, hf_dirs, tmp_path, route, family, peft, ranks, placement):
    """One cell of the grid. `make test` runs two: the bundled route on Qwen2 under ddp, and the
    manager's LoRA sharded zero3; the slow cells (`make test-all`) check what these two check."""
    data = TokenFile(_pairs(tmp_path / "p.tokens", count=PAIRS))
    reference = _reference(data)
    argv = _argv(hf_dirs / family, route, peft, placement, data.path, tmp_path / "run")
    results = world(ranks).run(dpo_step, argv=argv, reference=reference)
    ids = torch.cat([r[0] for r in results])
    assert sorted(ids.tolist()) == list(range(PAIRS))
    (chosen, rejected), value, metrics, grads = _trl_side(hf_dirs / family, argv, data, ids, reference)
    assert_parity(torch.cat([r[1] for r in results]), chosen, "logps/chosen")
    assert_parity(torch.cat([r[2] for r in results]), rejected, "logps/rejected")
    assert_parity(sum(r[3] for r in results) / PAIRS, value, "loss")
    assert math.isclose(metrics["logps/chosen"], float(chosen.mean()), rel_tol=1e-5)
    ours = results[0][4]
    assert sorted(ours) == sorted(grads)
    for name, theirs in grads.items():
        assert_parity(ours[name], theirs, name)

"""Mixture-of-experts directories as transformers' ``save_pretrained`` writes them (and every published
Qwen3-MoE, Qwen2-MoE and Mixtral checkpoint stores them): each expert under its own names, Mixtral's
under ``block_sparse_moe``. The manager route loads them into transformers 5's stacked experts, each
rank reading only its own experts' rows, trains them, and exports them under the same names."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from test_manager_hf import counting_reads
from test_manager_models import batch
from test_manager_moe import make_moe

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]


def _keys(directory) -> set[str]:
    from mfsdp.hf.files import weight_files

    return set(weight_files(directory))


def _logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits.float()


def moe_round_trip(rank, ws, tmp, family, ep=1):
    """save_pretrained -> meta build -> sharded load (experts split over ``ep``) -> logits; which expert
    tensors this rank read; save_hf_checkpoint -> from_pretrained -> logits and tensors, and the
    export's tensor names."""
    from mfsdp.hf.sharded import meta_model_from_config, save_hf_checkpoint
    from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh

    src, out, multi = (os.path.join(tmp, d) for d in ("src", "out", "multi"))
    ref = make_moe(family).eval()
    if rank == 0:
        ref.save_pretrained(src)
    dist.barrier()
    with counting_reads() as reads:
        manager = MegatronFSDPManager(MegatronFSDPConfig(init_fsdp_with_meta_device=True, ep_size=ep),
                                      build_device_mesh("cpu"))
        model, _ = manager.parallelize(meta_model_from_config(src), hf_path=src)
    experts_read = {int(name.split(".experts.")[1].split(".")[0]) for name, *_ in reads if ".experts." in name}
    x = batch(0, vocab=62).chunk(ws)[rank]
    logits = _logits(model, x)  # a collective: every rank
    load_err = float((logits - _logits(ref, x)).abs().max())
    save_hf_checkpoint(model, out)
    save_hf_checkpoint(model, multi, max_shard_bytes=4096)  # experts cut across files
    export_err, tensors_err, same_names = -1.0, -1.0, None
    if rank == 0:
        for path in (out, multi):
            loaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            export_err = max(export_err, float((_logits(loaded, x) - logits).abs().max()))
            theirs = loaded.state_dict()
            tensors_err = max(tensors_err, *(float((theirs[k] - v).abs().max()) for k, v in ref.state_dict().items()))
        same_names = _keys(out) == _keys(multi) == _keys(src) and len(os.listdir(multi)) > 3
    dist.barrier()
    return dict(load=load_err, export=export_err, tensors=tensors_err, same_names=same_names,
                experts=sorted(experts_read))


@pytest.mark.parametrize("family,ws", [("qwen3_moe", 2), ("mixtral", 2),
                                       pytest.param("qwen2_moe", 2, marks=pytest.mark.slow),
                                       pytest.param("qwen3_moe", 1, marks=pytest.mark.slow)])
def test_save_pretrained_moe_loads_and_exports(world, tmp_path, family, ws):
    results = world(ws).run(moe_round_trip, tmp=str(tmp_path), family=family)
    for rank, r in enumerate(results):
        assert r["load"] < 1e-5, r
        assert r["experts"] == ([[0, 1], [2, 3]][rank] if ws == 2 else [0, 1, 2, 3]), r  # its own experts only
    assert results[0]["export"] < 1e-5 and results[0]["tensors"] == 0.0 and results[0]["same_names"], results[0]


@pytest.mark.parametrize("ws,ep,experts", [
    (2, 2, [[0, 1], [2, 3]]),
    pytest.param(4, 2, [[0], [2], [1], [3]], marks=pytest.mark.slow)])  # rank = (ep_shard, ep): expert 2 ep + ep_shard
def test_save_pretrained_moe_loads_and_exports_with_ep(world, tmp_path, ws, ep, experts):
    """Experts split over ep (and sharded over what remains): each rank reads only its own experts'
    slices, the logits match transformers', the export holds the source's names and tensors."""
    results = world(ws).run(moe_round_trip, tmp=str(tmp_path), family="qwen3_moe", ep=ep)
    for rank, r in enumerate(results):
        assert r["load"] < 1e-5 and r["experts"] == experts[rank], (rank, r)
    assert results[0]["export"] < 1e-5 and results[0]["tensors"] == 0.0 and results[0]["same_names"], results[0]


def test_train_and_export_keep_the_checkpoint_names(world, tmp_path):
    """`mfsdp train --model.hf DIR` (the manager, two ranks, two steps) on a save_pretrained Qwen3-MoE
    directory, exported at the end (--train.export_hf): the export holds the source's tensor names and
    from_pretrained gives the trained model's logits. Its config asks for the load-balancing loss
    (output_router_logits), which the step adds and metrics.jsonl logs as aux_loss. Mixtral's cell:
    test_export_hf.py."""
    from test_export_hf import NO_SHAPE, TRAIN, assert_same_logits, trained_state
    from test_eval_loss import run_trainer
    from mfsdp.data import prepare
    from mfsdp.data.prepare import stdlib_source

    source, out, corpus = tmp_path / "source", tmp_path / "run", tmp_path / "small.tokens"
    model = make_moe("qwen3_moe", vocab=260)
    with torch.no_grad():
        model.lm_head.weight.mul_(200)  # confident, wrong logits: a loss far above a fresh init's ln 260
    model.config.output_router_logits = True
    model.save_pretrained(source)
    prepare(stdlib_source(), corpus, glob="a*.py")
    records = world(2).run(run_trainer, argv=[
        *NO_SHAPE, *TRAIN, "--data.path", str(corpus), "--train.out_dir", str(out), "--model.hf", str(source),
        "--model.hf_impl", "manager", "--data.packing", "false", "--train.export_hf", "true"])[0]
    assert [r["step"] for r in records] == [1, 2] and records[0]["loss"] > math.log(260) + 1, records
    assert all(r["aux_loss"] > 0.5 for r in records), records  # transformers' value: about top_k when balanced
    assert _keys(out / "hf") == _keys(source)
    config = transformers.AutoConfig.from_pretrained(source)
    reference = trained_state(out / "checkpoints" / "step_2",
                              transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    assert_same_logits(reference, out / "hf", 260)


def _has_ep_flag() -> bool:
    import dataclasses

    from mfsdp.train.run.config import ParallelSection

    return any(f.name == "ep" for f in dataclasses.fields(ParallelSection))


@pytest.mark.skipif(not _has_ep_flag(), reason="needs mfsdp train's --parallel.ep (branch ep-cli)")
def test_train_at_ep2_gives_the_ep1_losses(world, tmp_path):
    """`mfsdp train --model.hf DIR --model.hf_impl manager --parallel.ep 2` on two ranks: the losses and
    the load-balancing loss of ep 1 (1e-5), and an export under the source's per-expert names."""
    from test_export_hf import NO_SHAPE, TRAIN
    from test_eval_loss import run_trainer
    from mfsdp.data import prepare
    from mfsdp.data.prepare import stdlib_source

    source, corpus = tmp_path / "source", tmp_path / "small.tokens"
    model = make_moe("qwen3_moe", vocab=260)
    model.config.output_router_logits = True
    model.save_pretrained(source)
    prepare(stdlib_source(), corpus, glob="a*.py")
    runs = {ep: world(2).run(run_trainer, argv=[
        *NO_SHAPE, *TRAIN, "--data.path", str(corpus), "--train.out_dir", str(tmp_path / f"ep{ep}"),
        "--model.hf", str(source), "--model.hf_impl", "manager", "--data.packing", "false",
        "--train.export_hf", "true", "--parallel.ep", str(ep)])[0] for ep in (1, 2)}
    for key in ("loss", "aux_loss"):
        assert [r[key] for r in runs[2]] == pytest.approx([r[key] for r in runs[1]], abs=1e-5, rel=0), runs
    assert _keys(tmp_path / "ep2" / "hf") == _keys(source)


def test_stacked_slice_reads_only_the_experts_and_rows_asked_for(tmp_path):
    """The stacked view of per-expert files (mfsdp.hf.moe_names' rule): any block of experts and rows,
    across the gate/up boundary included, equals transformers' stacked tensor, reading nothing else."""
    from mfsdp.hf.files import WeightFiles, read_block
    from mfsdp.hf.moe_names import by_expert, exported_names, layout_of, on_disk

    model = make_moe("mixtral")
    model.save_pretrained(tmp_path)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    stacked = model.state_dict()[name]  # [4 experts, 2 * 24 rows, 16]
    pieces = on_disk(name, stacked.shape, layout_of(model))
    assert [p.key for p in pieces[:2]] == ["model.layers.1.block_sparse_moe.experts.0.w1.weight",
                                           "model.layers.1.block_sparse_moe.experts.0.w3.weight"]
    assert exported_names("model.layers.1.mlp.gate.weight", (4, 16), layout_of(model)) == [
        ("model.layers.1.block_sparse_moe.gate.weight", None)]
    with WeightFiles(tmp_path) as files:
        key = files.stack(by_expert(pieces))
        view = files.get_slice(key)
        assert view.get_shape() == list(stacked.shape)
        index = [torch.tensor([1, 2]), torch.arange(20, 30), torch.arange(16)]
        torch.testing.assert_close(read_block(view, index), stacked[1:3, 20:30], rtol=0, atol=0)
        assert files.sources(key) == [p.key for p in pieces]


def test_a_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    from mfsdp.hf.files import HFWeightsError
    from mfsdp.hf.sharded import load_hf_weights

    model = make_moe("qwen3_moe")
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFWeightsError, match=r"no tensor model.layers.1.mlp.experts.gate_up_proj \(stored per "
                                             r"expert; model.layers.1.mlp.experts.2.up_proj.weight is missing\)"):
        load_hf_weights(make_moe("qwen3_moe"), str(tmp_path))

"""Hugging Face checkpoints with the manager: meta-device init, slice-wise load, consolidated export."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from models import full_params as full, max_rel_error
from test_manager_models import batch, make_hf
from mfsdp.manager import MegatronFSDPConfig, MegatronFSDPManager, build_device_mesh, fully_shard_optimizer
from mfsdp.hf.files import local_indices
from mfsdp.hf.sharded import init_weights_shard_local, load_hf_weights, meta_model_from_config, save_hf_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits.float()


@contextlib.contextmanager
def counting_reads():
    """safetensors files opened so as to record every slice a rank reads: (name, elements read, elements
    in the tensor)."""
    import safetensors

    reads, real_open = [], safetensors.safe_open

    class CountingOpen:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            return self.f.__enter__()

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_slice(self, name):
            sl = self.f.get_slice(name)

            class S:
                def get_shape(self):
                    return sl.get_shape()

                def __getitem__(self, idx):
                    t = sl[idx]
                    reads.append((name, t.numel(), int(torch.tensor(sl.get_shape()).prod())))
                    return t

            return S()

    safetensors.safe_open = CountingOpen
    try:
        yield reads
    finally:
        safetensors.safe_open = real_open


def hf_round_trip(rank, ws, tmp, family="llama", tp=1, tied=True):
    """save_pretrained -> meta build -> sharded load (slices) -> equal logits; export -> from_pretrained."""
    import transformers

    vocab = 64 if tp > 1 else 62
    src, out, multi = (os.path.join(tmp, d) for d in ("src", "out", "multi"))
    ref = make_hf(family, vocab=vocab, tied=tied)
    if rank == 0:
        ref.save_pretrained(src)
    dist.barrier()
    with counting_reads() as reads:
        mesh = build_device_mesh("cpu", tp_size=tp)
        meta = meta_model_from_config(src)
        assert all(p.is_meta for p in meta.parameters())
        manager = MegatronFSDPManager(MegatronFSDPConfig(init_fsdp_with_meta_device=True), mesh)
        model, _ = manager.parallelize(meta, hf_path=src)
    x = batch(0, vocab=vocab)
    out_err = float((_logits(model, x) - _logits(ref, x)).abs().max())
    # Each rank read only slices: never a whole matrix (except tensors that are not split at all).
    whole = [n for n, got, total in reads if got == total and total > 64]
    read_fraction = sum(got for _, got, _ in reads) / sum(t.numel() for t in ref.state_dict().values())
    # Export (one file, then several files + index), from_pretrained on rank 0, equal weights.
    save_hf_checkpoint(model, out)
    save_hf_checkpoint(model, multi, max_shard_bytes=4096)
    export_err = -1.0
    if rank == 0:
        want = full(ref)
        for path in (out, multi):
            loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
            export_err = max(export_err, max_rel_error(full(loaded), want))
    n_files = len([f for f in os.listdir(multi) if f.endswith(".safetensors")])
    # The multi-file export loads back through the index, sharded, and trains.
    meta = meta_model_from_config(multi)
    model2, _ = MegatronFSDPManager(MegatronFSDPConfig(init_fsdp_with_meta_device=True), mesh).parallelize(
        meta, hf_path=multi)
    index_err = float((_logits(model2, x) - _logits(ref, x)).abs().max())
    opt = fully_shard_optimizer(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2))
    local = x.chunk(ws // tp)[rank // tp]
    model2(input_ids=local, labels=local).loss.backward()
    opt.step()
    dist.barrier()
    return dict(logits=out_err, whole=whole, fraction=read_fraction, export=export_err, files=n_files,
                index=index_err, finite=bool(torch.isfinite(_logits(model2, x)).all()))


@pytest.mark.parametrize("family,tied", [("llama", True), ("qwen2", False)])
def test_hf_round_trip_dp2(world, tmp_path, family, tied):
    results = world(2).run(hf_round_trip, tmp=str(tmp_path), family=family, tied=tied)
    for r in results:
        assert r["logits"] < 1e-5 and r["index"] < 1e-5, r
        assert r["whole"] == [] and r["fraction"] < 0.6, r  # about half of the model per rank
        assert r["files"] > 1 and r["finite"], r
    assert results[0]["export"] < 1e-6, results[0]


def test_hf_round_trip_tp2_dp2(world, tmp_path):
    results = world(4).run(hf_round_trip, tmp=str(tmp_path), family="llama", tp=2, tied=True)
    for r in results:
        assert r["logits"] < 1e-5 and r["index"] < 1e-5, r
        assert r["whole"] == [] and r["fraction"] < 0.35, r  # about a quarter of the model per rank
    assert results[0]["export"] < 1e-6, results[0]


def shard_local_init(rank, ws, tp=1):
    """Meta build + shard-local init equals the same init applied to the unsharded model."""
    vocab = 64
    ref = make_hf("qwen2", vocab=vocab)
    init_weights_shard_local(ref, seed=3)
    mesh = build_device_mesh("cpu", tp_size=tp)
    with torch.device("meta"):
        meta = make_hf("qwen2", vocab=vocab)
    model, _ = MegatronFSDPManager(MegatronFSDPConfig(init_fsdp_with_meta_device=True), mesh).parallelize(
        meta, init_seed=3)
    x = batch(0, vocab=vocab)
    err = float((_logits(model, x) - _logits(ref, x)).abs().max())
    std = float(ref.model.layers[0].mlp.up_proj.weight.detach().std())
    norm = float(ref.model.norm.weight.detach().min())
    with torch.device("meta"):
        meta = make_hf("qwen2", vocab=vocab)
    try:
        MegatronFSDPManager(MegatronFSDPConfig(), mesh).parallelize(meta)
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    return err, std, norm, refused


@pytest.mark.parametrize("ws,tp", [(2, 1), (4, 2)])
def test_meta_init_shard_local(world, ws, tp):
    err, std, norm, refused = world(ws).run(shard_local_init, tp=tp)[0]
    assert err < 1e-5 and 0.015 < std < 0.025 and norm == 1.0, (err, std, norm)
    assert "init_fsdp_with_meta_device=True" in refused


def test_local_indices_plain_tensor():
    t = torch.zeros(3, 4)
    rows, cols = local_indices(t)
    assert rows.tolist() == [0, 1, 2] and cols.tolist() == [0, 1, 2, 3]


def test_load_into_unsharded_model_and_errors(tmp_path):
    ref = make_hf("llama", tied=True)
    ref.save_pretrained(tmp_path / "m")
    other = make_hf("llama", tied=True, seed=5)
    load_hf_weights(other, str(tmp_path / "m"))
    assert max_rel_error(full(other), full(ref)) == 0
    wrong = make_hf("llama", vocab=30)
    with pytest.raises(KeyError, match="shape mismatch"):
        load_hf_weights(wrong, str(tmp_path / "m"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_weights(other, str(tmp_path))

"""mfsdp.hf.files, the one owner of Hugging Face weight files: a streamed write cut into several files
reads back through its index exactly (mixed dtypes, a 0-element tensor); the slice reader gives
the full read's block for ranges and for scattered rows; the error names each tensor and the
directory."""

from __future__ import annotations

import json

import pytest
import torch

from mfsdp.hf.files import (INDEX, SHARD_BYTES, WEIGHTS, Entry, HFWeightsError, NoWeightsError, WeightFiles,
                         has_weights, read_block, weight_files, write_weights)

pytest.importorskip("safetensors")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(10, 6, generator=g),
            "layers.0.norm.weight": torch.randn(7, generator=g).to(torch.bfloat16),  # 14 bytes: unaligned after
            "layers.0.mask": torch.rand(3, generator=g) > 0.5,
            "layers.0.w.weight": torch.randn(8, 5, generator=g),
            "empty": torch.zeros(0, 4),
            "head.weight": torch.randn(4, 6, generator=g).double()}


def test_a_streamed_write_reads_back_through_its_index(tmp_path):
    tensors = _tensors()
    entries = [Entry(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    order = []

    def read(entry: Entry) -> torch.Tensor:
        order.append(entry.name)
        return tensors[entry.name]

    (tmp_path / WEIGHTS).write_bytes(b"a stale single file")  # an earlier export's, replaced
    assert write_weights(tmp_path, entries, read, max_file_bytes=200) == 3  # 240 | 14 + 3 + 160 | 0 + 192 bytes
    assert order == list(tensors)  # once each, in order
    assert not (tmp_path / WEIGHTS).exists() and has_weights(tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(e.nbytes for e in entries)
    files = weight_files(tmp_path)
    assert set(files) == set(tensors) and len(set(files.values())) == 3
    from safetensors.torch import load_file

    loaded = {k: v for f in set(files.values()) for k, v in load_file(f).items()}
    assert all(torch.equal(loaded[k], t) and loaded[k].dtype == t.dtype for k, t in tensors.items())
    assert SHARD_BYTES == 5 * 10**9  # Hugging Face's max_shard_size="5GB"


def test_one_file_without_an_index_and_a_cast(tmp_path):
    w = torch.randn(3, 4)
    write_weights(tmp_path, [Entry("w", (3, 4), torch.bfloat16)], lambda e: w)
    assert not (tmp_path / INDEX).exists() and weight_files(tmp_path) == {"w": tmp_path / WEIGHTS}
    with WeightFiles(tmp_path) as files:
        assert torch.equal(files.get_slice("w")[:], w.bfloat16())


def test_the_slice_reader_reads_the_full_reads_block(tmp_path):
    w = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    write_weights(tmp_path, [Entry("w", (12, 10), torch.float32)], lambda e: w)
    rows, strided = torch.arange(4, 8), torch.tensor([1, 2, 7, 8])  # a range, and rows in two runs
    with WeightFiles(tmp_path) as files:
        sl = files.get_slice("w")
        assert tuple(sl.get_shape()) == (12, 10)
        assert torch.equal(read_block(sl, [slice(3, 6), slice(5, 10)]), w[3:6, 5:10])
        assert torch.equal(read_block(sl, [rows, torch.arange(10)]), w[4:8])
        assert torch.equal(read_block(sl, [strided, torch.tensor([0, 9])]), w[strided][:, [0, 9]])


def test_the_error_names_each_tensor_and_the_directory(tmp_path):
    err = HFWeightsError.of(tmp_path, missing=["model.a.weight (for a.weight)"],
                            extra=["model.b.bias"], model="the bundled model")
    assert isinstance(err, ValueError) and isinstance(err, KeyError) and "\n" not in str(err)
    assert str(err).startswith(f"{tmp_path}: no tensor model.a.weight (for a.weight) in its safetensors files; ")
    assert "tensor model.b.bias has no place in the bundled model" in str(err)
    many = str(HFWeightsError.of(tmp_path, mismatched=[f"t{i} has shape (2,), the model's t{i} (3,)" for i in range(6)]))
    assert "shape mismatch: t0 has shape (2,), the model's t0 (3,); t1" in many and "(and 2 more)" in many
    assert not has_weights(tmp_path)
    with pytest.raises(NoWeightsError, match=f"{tmp_path} holds neither model.safetensors") as raised:
        weight_files(tmp_path)
    assert isinstance(raised.value, FileNotFoundError) and isinstance(raised.value, HFWeightsError)

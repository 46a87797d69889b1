"""Token files, tokenizers, prepare-data and the deterministic sampler (one process)."""

import json

import pytest
import torch

from mfsdp.cli import main as cli_main
from mfsdp.data import (ByteTokenizer, DataError, TokenFile, WindowSampler, prepare,
                        write_token_file)
from mfsdp.data.token_file import HEADER_BYTES

pytestmark = pytest.mark.timeout(60)


def test_token_file_round_trip_keeps_ids_vocab_and_tokenizer(tmp_path):
    ids = torch.randint(0, 70000, (1000,))
    path = write_token_file(tmp_path / "t.tokens", ids, vocab_size=70000, tokenizer="bytes")
    data = TokenFile(path)
    assert len(data) == 1000 and data.vocab_size == 70000 and data.tokenizer == "bytes"
    assert data.tokens.dtype == torch.uint32  # 70000 ids do not fit 16 bits
    assert torch.equal(data.window(10, 20), ids[10:30])


@pytest.mark.parametrize("damage, message", [
    ("missing", "does not exist; create it with `mfsdp prepare-data"),
    ("not_ours", "not an mfsdp token file"),
    ("truncated", "truncated or corrupt"),
])
def test_bad_token_files_fail_with_one_clear_message(tmp_path, damage, message):
    path = tmp_path / "t.tokens"
    write_token_file(path, torch.arange(100), vocab_size=257, tokenizer="bytes")
    if damage == "missing":
        path.unlink()
    elif damage == "not_ours":
        path.write_bytes(b"hello world" * 50)
    else:
        path.write_bytes(path.read_bytes()[:HEADER_BYTES + 51])
    with pytest.raises(DataError, match=message):
        TokenFile(path)


def test_hints_name_the_models_tokenizer_and_never_write_over_the_input(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def error(path, model_hf="./llama"):
        with pytest.raises(DataError) as err:
            TokenFile(path, model_hf=model_hf)
        return str(err.value)

    assert error("chats.jsonl") == (
        "data file chats.jsonl does not exist; data.path names a token file, not .jsonl rows: create one with "
        "`mfsdp prepare-data INPUT data/chats.tokens --model.hf ./llama` and pass --data.path data/chats.tokens")
    assert error("t.tokens") == "data file t.tokens does not exist; create it with " \
        "`mfsdp prepare-data INPUT t.tokens --model.hf ./llama`"  # no byte-level demo corpus for an HF model
    assert error("t.tokens", None).endswith("`mfsdp prepare-data INPUT t.tokens`, or set data.path to 'stdlib' "
                                            "for the built-in demo corpus")
    (tmp_path / "chats.jsonl").write_text('{"text": "x"}\n' * 30)  # the rows themselves, as --data.path
    assert error("chats.jsonl") == (
        "chats.jsonl is not an mfsdp token file (bad header); if it holds your rows or text, tokenize it with "
        "`mfsdp prepare-data chats.jsonl data/chats.tokens --model.hf ./llama` and pass --data.path data/chats.tokens")
    (tmp_path / "data").mkdir()
    (tmp_path / "chats.jsonl").rename(tmp_path / "data" / "chats.tokens")
    assert "`mfsdp prepare-data data/chats.tokens data/chats.prepared.tokens`" in error("data/chats.tokens", None)
    write_token_file("t.tokens", torch.arange(100), vocab_size=257, tokenizer="bytes")
    (tmp_path / "t.tokens").write_bytes((tmp_path / "t.tokens").read_bytes()[:-1])
    assert error("t.tokens").endswith("re-create it with `mfsdp prepare-data INPUT t.tokens --model.hf ./llama`")


def test_prepare_text_jsonl_and_directory(tmp_path):
    (tmp_path / "a.txt").write_text("héllo")
    info = prepare(tmp_path / "a.txt", tmp_path / "a.tokens")
    data = TokenFile(tmp_path / "a.tokens")
    assert info["documents"] == 1
    assert ByteTokenizer().decode(data.window(0, len(data)).tolist()) == "héllo"
    assert data.window(len(data) - 1, 1).item() == ByteTokenizer.end_of_document

    rows = [{"text": "one"}, {"text": "two"}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert prepare(tmp_path / "b.jsonl", tmp_path / "b.tokens")["tokens"] == 3 + 1 + 3 + 1

    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match="bad.jsonl:1: .*--text-key"):
        prepare(tmp_path / "bad.jsonl", tmp_path / "c.tokens")

    (tmp_path / "src").mkdir()
    for name in ("x.py", "y.py", "z.txt"):
        (tmp_path / "src" / name).write_text("pass\n")
    assert prepare(tmp_path / "src", tmp_path / "d.tokens")["documents"] == 2


def test_prepare_data_command(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("some text " * 20)
    assert cli_main(["prepare-data", str(tmp_path / "in.txt"), str(tmp_path / "o.tokens")]) == 0
    assert "wrote 201 tokens" in capsys.readouterr().out
    assert cli_main(["prepare-data", str(tmp_path / "nope.txt"), str(tmp_path / "o2")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sampler_is_a_pure_function_of_seed_step_rank_and_world(tmp_path):
    ids = torch.arange(5000) % 251
    data = TokenFile(write_token_file(tmp_path / "t", ids, 257, "bytes"))

    def batch(rank, world, step, seed=0, micro=0, local=3):
        return WindowSampler(data, seq_len=16, local_batch=local, rank=rank,
                             world_size=world, seed=seed, microbatches=2).batch(step, micro)

    first = batch(0, 2, step=7)
    assert torch.equal(first.inputs, batch(0, 2, step=7).inputs)  # resumable: same again
    assert torch.equal(first.targets[:, :-1], first.inputs[:, 1:])  # targets shift by one
    assert not torch.equal(first.inputs, batch(1, 2, step=7).inputs)  # ranks differ
    assert not torch.equal(first.inputs, batch(0, 2, step=8).inputs)  # steps differ
    assert not torch.equal(first.inputs, batch(0, 2, step=7, seed=1).inputs)
    assert not torch.equal(first.inputs, batch(0, 2, step=7, micro=1).inputs)
    # The global batch of a step does not depend on how many ranks split it.
    whole = batch(0, 1, step=7, local=6).inputs
    assert torch.equal(whole, torch.cat([first.inputs, batch(1, 2, step=7).inputs]))


def test_sampler_rejects_a_file_shorter_than_one_window(tmp_path):
    data = TokenFile(write_token_file(tmp_path / "t", torch.arange(10), 257, "bytes"))
    with pytest.raises(DataError, match="too few"):
        WindowSampler(data, seq_len=16, local_batch=1, rank=0, world_size=1)

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
    with pytest.raises(DataError, match="bad.jsonl:1: .*--data.text_key"):
        prepare(tmp_path / "bad.jsonl", tmp_path / "c.tokens")

    (tmp_path / "src").mkdir()
    for name in ("x.py", "y.py", "z.txt", "notes.md"):
        (tmp_path / "src" / name).write_text("pass\n")
    (tmp_path / "src" / "rows.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    assert prepare(tmp_path / "src", tmp_path / "d.tokens", glob="*.py")["documents"] == 2
    # Without a pattern, a directory is read for its data files: the rows of each .jsonl (not its
    # JSON syntax), each .txt and .md whole; never its code.
    info = prepare(tmp_path / "src", tmp_path / "e.tokens")
    assert info["documents"] == 2 + 1 + 1 and info["tokens"] == 4 + 4 + 6 + 6
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "x.py").write_text("pass\n")
    with pytest.raises(DataError, match=r"no files match \*.jsonl \*.json \*.txt \*.md in .*; pass --data.glob"):
        prepare(tmp_path / "code", tmp_path / "f.tokens")


def test_prepare_data_command(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("some text " * 20)
    assert cli_main(["prepare-data", str(tmp_path / "in.txt"), str(tmp_path / "o.tokens")]) == 0
    assert "wrote 201 tokens" in capsys.readouterr().out
    assert cli_main(["prepare-data", str(tmp_path / "nope.txt"), str(tmp_path / "o2")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "dir").mkdir()
    for name, text in (("a.txt", "abc"), ("b.py", "import os\n"), ("c.jsonl", '{"text": "de"}\n')):
        (tmp_path / "dir" / name).write_text(text)
    assert cli_main(["prepare-data", str(tmp_path / "dir"), str(tmp_path / "d.tokens")]) == 0
    assert "wrote 7 tokens from 2 documents" in capsys.readouterr().out  # a.txt and c.jsonl's row, not b.py
    assert cli_main(["prepare-data", str(tmp_path / "dir"), str(tmp_path / "p.tokens"), "--data.glob", "*.py"]) == 0
    assert "wrote 11 tokens from 1 documents" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["prepare-data", "in", "out", "--data.max_lenn", "4"],
     "unknown config key data.max_lenn; did you mean --data.max_len? known keys of data: format,"),
    (["prepare-data", "in", "out", "--max-lne", "4"], "unknown flag --max-lne; did you mean --data.max_len?"),
    (["prepare-data", "in", "out", "--data.max_len"], "--data.max_len needs a value"),
    (["prepare-data", "in", "out", "--data.max_len", "many"], "--data.max_len expects int, got 'many'"),
    (["prepare-data", "in", "--data.format", "chat", "out"], "unknown format 'chat'; use one of text,"),
    (["prepare-data", "in"], "expects INPUT OUT, got 'in'"),
    (["export", "src", "out", "--export.dtpye", "fp32"], "did you mean --export.dtype?"),
    (["export", "src", "out", "--dtpye", "fp32"], "unknown flag --dtpye; did you mean --export.dtype?"),
    (["export", "src", "out", "--max-shard-gb"], "--max-shard-gb needs a value"),
    (["export", "src", "out", "--dtype", "fp8"], "export.dtype must be one of auto, bf16, fp32, got 'fp8'"),
    (["export", "src", "out", "--peft.merge_on_export", "maybe"], "--peft.merge_on_export expects bool, got 'maybe'"),
])
def test_prepare_data_and_export_parse_as_train_does(argv, message, capsys):
    """A misspelt flag names the nearest one, a flag without its value is named: one line, exit 2,
    no usage block, as `mfsdp train` says it."""
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mfsdp {argv[0]}: error: ") and message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("command", ["train", "plan", "prepare-data", "export"])
def test_help_gives_every_description_whole(command, capsys):
    """Every flag's description is whole, wrapped (none cut with " ..."), and each old spelling is
    named as one, beside the dotted flag it sets."""
    assert cli_main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert not [line for line in out.splitlines() if line.endswith(" ...")]  # no description cut
    text = " ".join(out.split())
    whole = {"train": "Plain stays the default until a GPU measurement shows fused pays.",  # a long docstring's end
             "plan": "Plain stays the default until a GPU measurement shows fused pays.",
             "prepare-data": "(training then cuts a sample longer than its window, and says so). Old spelling, kept "
                             "for one release: --max-len.",
             "export": "the checkpoint records it. Old spelling, kept for one release: --dtype."}
    assert whole[command] in text
    if command == "prepare-data":
        assert "Old spelling, kept for one release: --train-on-prompt (no value)." in text


def test_old_spellings_still_work(tmp_path, capsys):
    """The dash spellings of before the dotted flags are aliases for one release; --train-on-prompt
    stays a switch."""
    from mfsdp.cli import COMMANDS
    from mfsdp.train.command.args import parse_command

    _, sections, aliases, positional = COMMANDS["prepare-data"]
    old = ["in", "out", "--max-len", "8", "--format=messages", "--train-on-prompt", "--text-key", "body",
           "--glob", "*.md", "--tokenizer", "tok"]
    new = ["in", "out", "--data.max_len", "8", "--data.format=messages", "--data.train_on_prompt", "true",
           "--data.text_key", "body", "--data.glob", "*.md", "--data.tokenizer", "tok"]
    assert parse_command(old, sections, aliases, positional) == parse_command(new, sections, aliases, positional)
    assert parse_command(old, sections, aliases, positional)[1]["data"].train_on_prompt
    _, sections, aliases, positional = COMMANDS["export"]
    assert parse_command(["s", "--dtype", "fp32", "o", "--max-shard-gb", "2"], sections, aliases, positional) == \
        parse_command(["s", "o", "--export.dtype", "fp32", "--export.max_shard_gb=2"], sections, aliases, positional)


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

"""Preference pairs: `mfsdp prepare-data` on TRL's preference rows gives exactly the ids trl 1.16's
DPOTrainer builds (its own dataset preparation and collator, called directly), token-file version 3,
and one line with FILE:LINE for bad rows (one process, CPU)."""

import json
import struct
import types

import pytest
import torch

from mfsdp.cli import main as cli_main
from mfsdp.data import DataError, PackedSampler, TokenFile, write_token_file
from mfsdp.data.token_file import HEADER_BYTES, MAGIC

pytestmark = pytest.mark.timeout(120)

USER, ASSISTANT = "user", "assistant"


def _turn(role, content):
    return {"role": role, "content": content}


STRINGS = [{"prompt": "the answer is", "chosen": " forty two", "rejected": " hello world"},
           {"prompt": "how many apples?", "chosen": " three<|im_end|>", "rejected": " three"},  # ends with EOS
           {"chosen": "what is two plus two? four", "rejected": "what is two plus two? six"}]  # implicit, split before the space
CHATS = [{"prompt": [_turn("system", "be brief"), _turn(USER, "how many apples?")],
          "chosen": [_turn(ASSISTANT, "three apples")], "rejected": [_turn(ASSISTANT, "the answer is ten")]},
         {"prompt": [_turn(USER, "hello"), _turn(ASSISTANT, "hello world"), _turn(USER, "one plus two?")],
          "chosen": [_turn(ASSISTANT, "three")], "rejected": [_turn(ASSISTANT, "four")]},
         {"chosen": [_turn(USER, "tell me a number"), _turn(ASSISTANT, "seven")],  # implicit
          "rejected": [_turn(USER, "tell me a number"), _turn(ASSISTANT, "good thanks")]}]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The tiny model directory of ``mfsdp.hf.random_model`` ("chatml"), its tokenizer with a BOS added to
    every text ("bos"), and that one without a chat template ("plain")."""
    pytest.importorskip("trl")
    from tokenizers import processors
    from transformers import AutoTokenizer

    from mfsdp.hf.random_model import make_model, make_tokenizer
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("chatml", "bos", "plain")}
    make_model(dirs["chatml"], "tiny")
    make_tokenizer(dirs["chatml"])
    tok = AutoTokenizer.from_pretrained(dirs["chatml"], local_files_only=True)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    tok.save_pretrained(dirs["bos"])
    tok.chat_template = None
    tok.save_pretrained(dirs["plain"])
    return dirs


def _tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _trl(tok, row, max_len=None):
    """trl 1.16's pair of ``row``: DPOTrainer's dataset preparation (prompt extraction, EOS, tokenization,
    the max_length filter), then its collator's truncation: (prompt, prompt + chosen, prompt + rejected),
    or None when trl drops the pair."""
    from datasets import Dataset
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=max_len, truncation_mode="keep_start")
    ds = DPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=tok), Dataset.from_list([row]), tok, args,
                                     "train")
    if len(ds) == 0:
        return None
    batch = DataCollatorForPreference(pad_token_id=-1, max_length=max_len)([ds[0]])
    chosen, rejected = (ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"]))
    return ds[0]["prompt_ids"], chosen, rejected


def _prepare(tmp_path, rows, *flags, name="pairs.tokens"):
    source, out = tmp_path / "pairs.jsonl", tmp_path / name
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert cli_main(["prepare-data", str(source), str(out), *flags]) == 0
    return TokenFile(out)


def _ours(data, i):
    prompt, chosen, rejected = (part.tolist() for part in data.pair(i))
    return prompt, prompt + chosen, prompt + rejected


@pytest.mark.parametrize("name, rows", [("bos", STRINGS), ("plain", STRINGS), ("chatml", STRINGS),
                                        ("chatml", CHATS), ("bos", CHATS)])
def test_pairs_are_the_ids_trl_builds(tmp_path, hf, capsys, name, rows):
    tok = _tokenizer(hf[name])
    data = _prepare(tmp_path, rows, "--model.hf", str(hf[name]))
    assert data.is_pairs and data.version == 3 and data.num_samples == len(rows) and data.loss_mask is None
    for i, row in enumerate(rows):
        assert _ours(data, i) == _trl(tok, row), row
    if name == "bos" and rows is STRINGS:  # trl's BOS: tokenizer(text) adds it (ChatML's template writes none)
        assert all(data.pair(i)[0][0] == tok.bos_token_id for i in range(len(rows)))
        assert all(data.pair(i)[0].tolist().count(tok.bos_token_id) == 1 for i in range(len(rows)))
    prompt, chosen, rejected = data.pair(0)
    start, length = int(data.sample_starts[0]), int(data.sample_lengths[0])
    assert data.segments[start:start + length].tolist() == \
        [0] * len(prompt) + [1] * len(chosen) + [2] * len(rejected)
    assert f"wrote {len(rows)} preference pairs, {len(data)} tokens" in capsys.readouterr().out


def test_max_len_cuts_each_prompt_and_answer_as_trls_max_length(tmp_path, hf, capsys):
    tok = _tokenizer(hf["chatml"])
    rows = [*STRINGS, *CHATS]
    prompt_of = [len(_trl(tok, row)[0]) for row in rows]
    max_len = sorted(prompt_of)[-1]  # the longest prompt fills it: trl drops that pair
    data = _prepare(tmp_path, rows, "--model.hf", str(hf["chatml"]), "--data.max_len", str(max_len))
    kept = [_trl(tok, row, max_len) for row in rows]
    assert kept.count(None) == prompt_of.count(max_len) and data.num_samples == len(rows) - kept.count(None)
    assert [_ours(data, i) for i in range(data.num_samples)] == [pair for pair in kept if pair is not None]
    full = [_trl(tok, row) for row in rows]
    cut = sum(len(a) - len(b) for whole, capped in zip(full, kept) if capped for a, b in zip(whole[1:], capped[1:]))
    truncated = sum(capped is not None and capped != whole for whole, capped in zip(full, kept))
    assert (f"--data.max_len {max_len} (trl's max_length) cut {truncated} of {data.num_samples} pairs to {max_len} "
            f"tokens per prompt and answer ({cut} tokens) and dropped {kept.count(None)} whose prompt alone fills it"
            ) in capsys.readouterr().out
    assert cut > 0 and truncated > 0


def test_a_tokenizer_without_a_template_renders_chats_with_mfsdps_where_trl_refuses(tmp_path, hf):
    from mfsdp.data.template import render_chat
    tok = _tokenizer(hf["plain"])
    with pytest.raises(ValueError):
        _trl(tok, CHATS[0])
    data = _prepare(tmp_path, CHATS[:1], "--model.hf", str(hf["plain"]))
    prompt, chosen, _ = data.pair(0)
    row = CHATS[0]
    assert prompt.tolist() == tok(render_chat(row["prompt"], True, tok.eos_token))["input_ids"]
    assert tok.decode(chosen) == "three apples" + tok.eos_token


def test_equal_answers_are_kept_and_counted(tmp_path, capsys):
    rows = [{"prompt": "q", "chosen": "same", "rejected": "same"}, {"prompt": "q", "chosen": "a", "rejected": "b"},
            {"chosen": [_turn(USER, "u"), _turn(ASSISTANT, "a")], "rejected": [_turn(USER, "u"), _turn(ASSISTANT, "a")]}]
    data = _prepare(tmp_path, rows)
    assert data.num_samples == 3
    assert [data.pair(i)[1].tolist() == data.pair(i)[2].tolist() for i in range(3)] == [True, False, True]
    out = capsys.readouterr().out
    assert "2 of 3 pairs have the same chosen and rejected answer: kept, as trl keeps them" in out
    assert out.count("\n") == 2  # what was written, and the equal answers: no cut line without --data.max_len


# ----------------------------------------------------------------------------- bad input
GOOD = {"prompt": "p", "chosen": "a", "rejected": "b"}


@pytest.mark.parametrize("rows, line, problem", [
    ([GOOD, {"prompt": "p", "chosen": "a"}], 2, "a preference row needs 'chosen' and 'rejected' (its keys: "
                                                "'prompt', 'chosen'); add 'rejected', or drop the row"),
    ([GOOD, {"prompt": "p", "chosen": "a", "rejected": " "}], 2, "the rejected answer is empty; give the answer"),
    ([{"prompt": [_turn(USER, "u")], "chosen": [_turn(ASSISTANT, "")], "rejected": [_turn(ASSISTANT, "b")]}], 1,
     "the chosen answer has no assistant turn with content"),
    ([GOOD, GOOD, {"chosen": [_turn(USER, "u"), _turn(ASSISTANT, "a")], "rejected": [_turn(USER, "v")]}], 3,
     "'chosen' and 'rejected' share no opening turn, and without a 'prompt' their shared opening is the "
     "prompt; add the 'prompt' field, or fix the row"),
    ([{"chosen": "abc", "rejected": "xyz"}], 1, "share no opening turn"),
    ([{"prompt": "p", "chosen": [_turn(ASSISTANT, "a")], "rejected": "b"}], 1, "must all be strings or all be lists"),
    ([GOOD, {"prompt": "p", "completion": "c"}], 2, "a prompt_completion row in a file of preference pairs"),
])
def test_a_bad_pair_is_one_line_with_file_and_line_and_writes_nothing(tmp_path, capsys, rows, line, problem):
    source, out = tmp_path / "pairs.jsonl", tmp_path / "out.tokens"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out.write_bytes(b"an earlier file")
    assert cli_main(["prepare-data", str(source), str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith(f"mfsdp prepare-data: error: {source}:{line}: ") and problem in captured.err
    assert out.read_bytes() == b"an earlier file" and sorted(tmp_path.iterdir()) == [out, source]


def test_a_trl_file_is_read_as_pairs_without_a_format_and_sample_flags_are_refused(tmp_path, capsys):
    data = _prepare(tmp_path, [GOOD])  # once: "a prompt_completion row needs 'prompt' and 'completion'"
    assert data.is_pairs
    source = tmp_path / "pairs.jsonl"
    assert cli_main(["prepare-data", str(source), str(tmp_path / "o"), "--data.train_on_prompt", "true"]) == 2
    assert "--data.train_on_prompt applies to fine-tuning samples" in capsys.readouterr().err
    assert cli_main(["prepare-data", str(source), str(tmp_path / "o"), "--data.format", "preference"]) == 0


# ------------------------------------------------------------------------ token-file version 3
def _pair_file(tmp_path, sizes):
    ids = torch.arange(sum(sum(s) for s in sizes)) % 250
    segments = torch.cat([torch.repeat_interleave(torch.arange(3), torch.tensor(s)) for s in sizes])
    lengths = torch.tensor([sum(s) for s in sizes])
    return write_token_file(tmp_path / "p.tokens", ids, 257, "bytes", sample_starts=torch.cumsum(lengths, 0) - lengths,
                            segments=segments)


def test_version_3_keeps_version_2s_layout_and_splits_pairs(tmp_path):
    path = _pair_file(tmp_path, [(2, 1, 3), (1, 2, 2)])
    data = TokenFile(path)
    assert data.is_pairs and data.num_samples == 2 and data.sample_lengths.tolist() == [6, 5]
    assert [p.tolist() for p in data.pair(1)] == [[6], [7, 8], [9, 10]]
    assert data.segments.tolist() == [0, 0, 1, 2, 2, 2, 0, 1, 1, 2, 2]
    raw = path.read_bytes()
    assert raw[:8] == MAGIC and struct.unpack_from("<I", raw, 8)[0] == 3  # where a 1-2 reader looks: refused
    mask_at = struct.unpack_from("<Q", raw, 52)[0]
    assert len(raw) == mask_at + 11 and mask_at >= HEADER_BYTES + 22  # version 2's sections, a byte per token
    damaged = bytearray(raw)
    damaged[mask_at + 7] = 2  # pair 1: prompt, rejected, chosen, ...
    path.write_bytes(bytes(damaged))
    with pytest.raises(DataError, match="is corrupt: pair 1 is not a prompt, a chosen and a rejected answer"):
        TokenFile(path).pair(1)


def test_fine_tuning_refuses_a_pair_file_in_one_line(tmp_path):
    data = TokenFile(_pair_file(tmp_path, [(2, 1, 3), (1, 2, 2)]))
    with pytest.raises(DataError, match=r"holds preference pairs \(token-file version 3\), which fine-tuning's"):
        PackedSampler(data, 16, 2, 0, 1)

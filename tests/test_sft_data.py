"""Fine-tuning data: prompt/completion and chat rows, their loss masks, token-file version 2,
the packed sampler and held-out samples (one process, CPU)."""

import json
import struct

import pytest
import torch

from mfsdp.cli import main as cli_main
from mfsdp.data import (ByteTokenizer, DataError, PackedEvalWindows, PackedSampler, TokenFile, WindowSampler,
                        held_out_samples, write_token_file)
from mfsdp.data.packing import IGNORE
from mfsdp.data.template import render_chat
from mfsdp.data.token_file import HEADER_BYTES, MAGIC

pytestmark = pytest.mark.timeout(120)

EOS = 256  # the byte tokenizer's end of document


def _b(text: str) -> list[int]:
    return list(text.encode())


def _rows(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _prepare(tmp_path, rows, *flags, name="out.tokens"):
    """Run `mfsdp prepare-data` on ``rows``; the file written, as a TokenFile."""
    out = tmp_path / name
    assert cli_main(["prepare-data", _rows(tmp_path / "rows.jsonl", rows), str(out), *flags]) == 0
    return TokenFile(out)


def _expected(pieces) -> tuple[list[int], list[int]]:
    """Ids and mask from (ids, counted) pieces, the first token never counted."""
    ids = [i for piece, _ in pieces for i in piece]
    mask = [int(counted) for piece, counted in pieces for _ in piece]
    return ids, [0] + mask[1:]


def _sample(data: TokenFile, i: int) -> tuple[list[int], list[int]]:
    start, length = int(data.sample_starts[i]), int(data.sample_lengths[i])
    return (data.tokens[start:start + length].tolist(),
            data.loss_mask[start:start + length].tolist())


# ------------------------------------------------------------------ rows with the byte tokenizer
def test_prompt_completion_counts_the_completion_and_its_end(tmp_path, capsys):
    data = _prepare(tmp_path, [{"prompt": "Q:", "completion": "A"},
                               {"prompt": "", "completion": "yes"}])
    assert data.version == 2 and data.num_samples == 2
    assert _sample(data, 0) == ([*_b("Q:A"), EOS], [0, 0, 1, 1])
    assert _sample(data, 1) == ([*_b("yes"), EOS], [0, 1, 1, 1])  # the first token: no one's target
    assert ("wrote 2 prompt_completion samples, 8 tokens, 5 answer tokens counted in the loss, "
            "0 samples truncated") in capsys.readouterr().out


def test_messages_use_mfsdps_template_and_count_every_assistant_turn(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yes"}, {"role": "user", "content": "more"},
            {"role": "assistant", "content": "no"}]
    data = _prepare(tmp_path, [{"messages": chat}])
    assert _sample(data, 0) == _expected([
        (_b("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"), False), (_b("yes"), True),
        ([EOS], True), (_b("<|user|>\nmore\n<|assistant|>\n"), False), (_b("no"), True), ([EOS], True)])


def test_conversational_prompt_completion_counts_only_the_completion(tmp_path):
    prompt = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
              {"role": "user", "content": "c"}]
    data = _prepare(tmp_path, [{"prompt": prompt, "completion": [{"role": "assistant", "content": "d"}]}])
    assert _sample(data, 0) == _expected([
        (_b("<|user|>\na\n<|assistant|>\nb"), False), ([EOS], False),  # the prompt's own answer
        (_b("<|user|>\nc\n<|assistant|>\n"), False), (_b("d"), True), ([EOS], True)])


def test_train_on_prompt_counts_every_token_and_max_len_truncates(tmp_path, capsys):
    def chat(user, answer):
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}

    rows = [chat("hello", "x"), chat("p", "c")]
    data = _prepare(tmp_path, rows, "--data.train_on_prompt", "true")
    ids, mask = _sample(data, 0)
    assert ids == [*_b("<|user|>\nhello\n<|assistant|>\nx"), EOS] and mask == [0] + [1] * (len(ids) - 1)
    assert sum(_sample(data, 1)[1]) == int(data.sample_lengths[1]) - 1
    capsys.readouterr()
    data = _prepare(tmp_path, rows, "--data.max_len", "30", name="cut.tokens")
    assert data.sample_lengths.tolist() == [30, 27]  # 31 tokens cut to 30 (its end), 27 kept
    assert _sample(data, 0) == _expected([(_b("<|user|>\nhello\n<|assistant|>\n"), False), (_b("x"), True)])
    assert "1 samples truncated to 30 tokens (1 tokens cut)" in capsys.readouterr().out


def test_text_rows_still_write_a_version_1_stream(tmp_path):
    data = _prepare(tmp_path, [{"text": "one"}, {"text": "two"}])
    assert data.version == 1 and data.sample_starts is None and data.loss_mask is None
    assert data.tokens.tolist() == [*_b("one"), EOS, *_b("two"), EOS]


# ------------------------------------------------------------------------ bad rows
GOOD = {"prompt": "p", "completion": "c"}
CHAT = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}


@pytest.mark.parametrize("rows, line, problem", [
    ([{"body": "x"}], 1, "a row in none of the formats"),
    ([CHAT, {"messages": [{"role": "ipython", "content": "42"}, {"role": "assistant", "content": "a"}]}],
     2, "message 0 has role 'ipython'"),
    ([GOOD, GOOD, {"prompt": "p", "completion": "  "}], 3, "the completion is empty"),
    ([{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": ""}]}], 1,
     "no assistant turn with content"),
    ([{"prompt": [{"role": "user", "content": "u"}], "completion": [{"role": "user", "content": "v"}]}],
     1, "the completion has no assistant turn"),
    ([GOOD, '{"prompt": "p", "completion": '], 2, "invalid JSON"),
    (["[1, 2]"], 1, "a row must be a JSON object"),
    ([GOOD, CHAT, {"text": "t"}], 3, "a text row in a file of samples"),
    ([{"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]}], 1,
     "conversations turn 1 is from 'bot'; ShareGPT turns are from human, user, gpt"),
    ([{"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "f("}]}], 1,
     "turn 1 (function_call) is not JSON"),
    ([{"instruction": "i", "input": "x"}], 1, "an alpaca row needs 'instruction' and 'output'"),
    ([{"instruction": "i", "output": " "}], 1, "no assistant turn with content"),
    ([{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], "tools": 3}], 1,
     "'tools' must be a list of function schemas"),
    ([{"prompt": "p", "completion": [{"role": "assistant", "content": "a"}]}], 1,
     "must both be strings or both be lists"),
    ([{"messages": [{"role": "user", "content": ["parts"]}]}], 1, "a string 'content'"),
    ([{"prompt": "p", "completion": "c\uffff"}], 1, "end-of-sequence text"),
])
def test_a_bad_row_is_one_line_with_file_and_line_and_writes_nothing(tmp_path, capsys, rows, line, problem):
    source, out = _rows(tmp_path / "rows.jsonl", rows), tmp_path / "out.tokens"
    assert cli_main(["prepare-data", source, str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith(f"mfsdp prepare-data: error: {source}:{line}: ")
    assert problem in captured.err
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "rows.jsonl"]


def test_bytes_that_are_not_utf8_are_one_line_and_an_existing_output_stays(tmp_path, capsys):
    source, out = tmp_path / "rows.jsonl", tmp_path / "out.tokens"
    out.write_bytes(b"an earlier file")
    source.write_bytes(b'\xef\xbb\xbf{"text": "caf\xc3\xa9"}\n{"text": "caf\xe9"}\n')  # a BOM, then Latin-1
    assert cli_main(["prepare-data", str(source), str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"mfsdp prepare-data: error: {source}:2: byte 0xe9 at column 14 is not UTF-8 text; re-save "
                   "the file as UTF-8, or fix or drop the line\n")
    source.write_bytes(b'{"prompt": "p", "completion": "c"}\n{"prompt": 1}\n')
    assert cli_main(["prepare-data", str(source), str(out)]) == 2
    assert f"{source}:2: " in capsys.readouterr().err
    assert out.read_bytes() == b"an earlier file" and sorted(tmp_path.iterdir()) == [out, source]  # no temp file


def test_sample_flags_on_text_rows_are_refused(tmp_path, capsys):
    source = _rows(tmp_path / "rows.jsonl", [{"text": "t"}])
    assert cli_main(["prepare-data", source, str(tmp_path / "o"), "--data.train_on_prompt", "true"]) == 2
    assert "apply to samples (prompt/completion, messages, ShareGPT or Alpaca rows)" in capsys.readouterr().err


# ---------------------------------------------------------------- Hugging Face tokenizers
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BROKEN = CHATML + "{{ messages | length }}"  # earlier turns end differently once more follow


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny byte-level BPE tokenizer saved three times: with a ChatML template, without a
    template, and with a template that breaks the prefix property."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        ["hello world, how are you today?", "the answer is forty two", "user assistant system"] * 20,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    dirs = {}
    for name, template in (("chatml", CHATML), ("plain", None), ("broken", BROKEN)):
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
        tok.chat_template = template
        dirs[name] = tmp_path_factory.mktemp(name)
        tok.save_pretrained(dirs[name])
    return dirs, AutoTokenizer.from_pretrained(dirs["chatml"], local_files_only=True)


def _counted_text(tok, data, i):
    ids, mask = _sample(data, i)
    return tok.decode(ids), tok.decode([t for t, m in zip(ids, mask) if m])


def test_a_chat_template_gives_the_ids_of_the_whole_conversation_and_masks_its_answers(tmp_path, hf):
    dirs, tok = hf
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "the answer"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "how are you"}]
    data = _prepare(tmp_path, [{"messages": chat}], "--model.hf", str(dirs["chatml"]))
    assert data.tokenizer == str(dirs["chatml"].resolve())  # --tokenizer defaults to --model.hf
    whole = tok.apply_chat_template(chat, tokenize=False)
    ids = _sample(data, 0)[0]
    assert ids == tok(whole, add_special_tokens=False)["input_ids"]  # tokenized once, not by turn
    assert ids == list(tok.apply_chat_template(chat)["input_ids"])
    assert _counted_text(tok, data, 0) == (whole, "the answer<|im_end|>\nhow are you<|im_end|>\n")

    prompt = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"},
              {"role": "user", "content": "today?"}]
    rows = [{"prompt": prompt, "completion": [{"role": "assistant", "content": "forty two"}]}]
    data = _prepare(tmp_path, rows, "--data.tokenizer", str(dirs["chatml"]), name="pc.tokens")
    whole = tok.apply_chat_template(prompt + rows[0]["completion"], tokenize=False)
    assert _sample(data, 0)[0] == tok(whole, add_special_tokens=False)["input_ids"]
    assert _counted_text(tok, data, 0) == (whole, "forty two<|im_end|>\n")


def test_plain_strings_and_template_less_tokenizers_end_answers_with_eos(tmp_path, hf):
    dirs, tok = hf
    data = _prepare(tmp_path, [{"prompt": "the answer is", "completion": " forty two"}],
                    "--data.tokenizer", str(dirs["plain"]))
    assert _sample(data, 0)[0] == tok("the answer is forty two<|endoftext|>")["input_ids"]
    assert _counted_text(tok, data, 0)[1] == " forty two<|endoftext|>"
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    data = _prepare(tmp_path, [{"messages": chat}], "--data.tokenizer", str(dirs["plain"]), name="c.tokens")
    assert _counted_text(tok, data, 0) == (render_chat(chat, False, "<|endoftext|>"), "world<|endoftext|>")


def test_a_template_breaking_the_prefix_property_is_refused_in_one_line(tmp_path, hf, capsys):
    dirs, _ = hf
    source = _rows(tmp_path / "rows.jsonl", [CHAT])
    out = tmp_path / "out.tokens"
    assert cli_main(["prepare-data", source, str(out), "--data.tokenizer", str(dirs["broken"])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mfsdp prepare-data: error: {source}:1: the chat template of ")
    assert "breaks the prefix property" in err and err.count("\n") == 1 and not out.exists()
    assert cli_main(["prepare-data", source, str(out), "--data.tokenizer", str(dirs["broken"]),
                     "--data.train_on_prompt", "true"]) == 0  # needs no answer spans


# ------------------------------------------------------------------------ token file v2
def _synthetic(tmp_path, lengths, name="s.tokens"):
    """Samples whose token ids say where they come from: sample i, offset j has id 100 i + j;
    the loss counts the second half of each sample."""
    ids = torch.cat([100 * i + torch.arange(n) for i, n in enumerate(lengths)])
    mask = torch.cat([torch.arange(n) >= n // 2 for n in lengths])
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    return TokenFile(write_token_file(tmp_path / name, ids, 100 * len(lengths), "bytes",
                                      loss_mask=mask, sample_starts=starts))


def test_version_2_round_trips_and_keeps_the_magic_and_version_where_old_readers_look(tmp_path):
    data = _synthetic(tmp_path, [3, 5, 2])
    assert data.version == 2 and data.num_samples == 3 and len(data) == 10
    assert data.sample_starts.tolist() == [0, 3, 8] and data.sample_lengths.tolist() == [3, 5, 2]
    assert data.loss_mask.tolist() == [0, 1, 1, 0, 0, 1, 1, 1, 0, 1]
    assert data.window(3, 2).tolist() == [100, 101]
    raw = (tmp_path / "s.tokens").read_bytes()
    old_version = struct.unpack_from("<I", raw, 8)[0]  # what mfsdp before version 2 checks
    assert raw[:8] == MAGIC and old_version == 2 and old_version != 1
    (tmp_path / "v4").write_bytes(raw[:8] + struct.pack("<I", 4) + raw[12:])
    with pytest.raises(DataError, match="has token-file version 4, this mfsdp reads versions 1, 2 and 3"):
        TokenFile(tmp_path / "v4")


@pytest.mark.parametrize("damage, message", [
    ("truncated", "truncated or corrupt"),
    ("bounds", "its sample bounds do not split"),
    ("header", "corrupt header"),
])
def test_damaged_version_2_files_raise_data_error(tmp_path, damage, message):
    _synthetic(tmp_path, [3, 5, 2])
    path = tmp_path / "s.tokens"
    raw = bytearray(path.read_bytes())
    bounds_at = struct.unpack_from("<Q", raw, 44)[0]
    if damage == "truncated":
        raw = raw[:-1]
    elif damage == "bounds":
        struct.pack_into("<q", raw, bounds_at + 8, 9)  # sample 1 starts after sample 2
    else:
        struct.pack_into("<Q", raw, 44, bounds_at + 8)
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=message):
        TokenFile(path)


def test_version_1_streams_still_read_and_feed_the_window_sampler(tmp_path):
    data = TokenFile(write_token_file(tmp_path / "t", torch.arange(500) % 250, 257, "bytes"))
    assert data.version == 1 and data.num_samples is None and data.loss_mask is None
    assert (tmp_path / "t").stat().st_size == HEADER_BYTES + 1000
    batch = WindowSampler(data, 16, 2, 0, 1).batch(1)
    assert batch.positions is None and batch.document_ids is None  # plain causal, as before
    with pytest.raises(DataError, match="plain token stream"):
        PackedSampler(data, 16, 2, 0, 1)


# -------------------------------------------------------------------------- the sampler
LENGTHS = [int(n) for n in torch.randint(2, 21, (40,), generator=torch.Generator().manual_seed(0))]


def _reference_targets(batch) -> torch.Tensor:
    """Per position, by hand: the next id where it continues the same sample and the mask
    (second half of the sample) counts it, else -100."""
    out = torch.full_like(batch.inputs, IGNORE)
    for r in range(batch.inputs.shape[0]):
        for j in range(batch.inputs.shape[1] - 1):
            doc, nxt = batch.document_ids[r, j], batch.document_ids[r, j + 1]
            if doc >= 0 and nxt == doc:
                sample, offset = divmod(int(batch.inputs[r, j + 1]), 100)
                if offset >= LENGTHS[sample] // 2:
                    out[r, j] = batch.inputs[r, j + 1]
    return out


def _epoch_samples(sampler, epoch):
    """The samples the batches of ``epoch`` start, in order."""
    found = []
    for step in range(epoch * sampler.steps_per_epoch + 1, (epoch + 1) * sampler.steps_per_epoch + 1):
        for micro in range(sampler.microbatches):
            b = sampler.batch(step, micro)
            found += (b.inputs[(b.positions == 0) & (b.document_ids >= 0)] // 100).tolist()
    return found


def test_packed_windows_restart_positions_and_mask_targets(tmp_path):
    data = _synthetic(tmp_path, LENGTHS)
    sampler = PackedSampler(data, seq_len=16, local_batch=3, rank=0, world_size=1, microbatches=2)
    assert sampler.truncated == sum(n > 16 for n in LENGTHS) > 0
    windows = sampler.windows
    batch = windows.batch(list(range(len(windows))))  # every window at once
    real = batch.document_ids >= 0
    samples = batch.inputs // 100
    assert torch.equal(batch.positions[real], batch.inputs[real] % 100)  # offset in its sample
    # Every sample once, whole, or its first 16 tokens when longer than a window.
    assert torch.bincount(samples[real], minlength=40).tolist() == [min(n, 16) for n in LENGTHS]
    for row in range(len(windows)):  # one document id per sample, distinct within a row
        pairs = set(zip(batch.document_ids[row][real[row]].tolist(), samples[row][real[row]].tolist()))
        assert len(pairs) == len({d for d, _ in pairs}) == len({s for _, s in pairs})
    assert torch.equal(batch.targets, _reference_targets(batch))
    assert (batch.targets[~real] == IGNORE).all()
    assert len(windows) < 40 and real.sum() == sum(min(n, 16) for n in LENGTHS)
    assert torch.equal(sampler.batch(1, 1).inputs, windows.batch(
        [int(w) for w in sampler.window_order(0)[3:6]]).inputs)  # step 1, microbatch 1


def test_the_sampler_is_a_pure_function_and_each_epoch_visits_every_sample_once(tmp_path):
    data = _synthetic(tmp_path, LENGTHS)

    def sampler(rank=0, world=1, local=4, seed=0):
        return PackedSampler(data, 16, local, rank, world, seed=seed, microbatches=2)

    a = sampler()
    once, again = a.batch(3, 1), sampler().batch(3, 1)  # a fresh sampler: a resume
    assert torch.equal(once.inputs, again.inputs) and torch.equal(once.targets, again.targets)
    assert not torch.equal(a.batch(3, 1).inputs, sampler(seed=1).batch(3, 1).inputs)
    first, second = _epoch_samples(a, 0), _epoch_samples(a, 1)
    assert sorted(first) == sorted(second) == list(range(40)) and first != second
    assert first == a.epoch_samples(0).tolist()
    spe = a.steps_per_epoch
    assert spe == -(-len(a.windows) // 8) and a.epoch_of(1) == 0 and a.epoch_of(spe) == 0
    assert a.epoch_of(spe + 1) == 1
    last = [a.batch(spe, m) for m in range(2)]  # topped up with empty windows
    empty = len(a.windows) % 8 and 8 - len(a.windows) % 8
    assert sum(bool((b.targets[r] == IGNORE).all()) for b in last for r in range(4)) == empty
    # The global batch does not depend on the world size.
    for step in (1, spe + 2):
        for micro in range(2):
            whole = sampler(local=4).batch(step, micro).inputs
            for world in (2, 4):
                parts = [sampler(r, world, 4 // world).batch(step, micro).inputs for r in range(world)]
                assert torch.equal(torch.cat(parts), whole)


def test_without_packing_each_window_holds_one_sample(tmp_path):
    data = _synthetic(tmp_path, LENGTHS)
    sampler = PackedSampler(data, 16, 5, 0, 1, packing=False)
    assert len(sampler.windows) == 40 and sampler.steps_per_epoch == 8
    batch = sampler.batch(1)
    assert set(batch.document_ids.unique().tolist()) <= {-1, 0}
    assert sorted(_epoch_samples(sampler, 0)) == list(range(40))


def test_held_out_samples_are_never_trained_on(tmp_path):
    data = _synthetic(tmp_path, LENGTHS)
    held = held_out_samples(40, 0.1)
    assert held == 4 and held_out_samples(40, 0.001) == 1 and held_out_samples(40, 0) == 0
    train = PackedSampler(data, 16, 2, 0, 1, microbatches=2, samples=range(40 - held))
    seen = {s for epoch in range(3) for s in _epoch_samples(train, epoch)}
    assert seen == set(range(36))

    def evaluated(world, local, micro):
        rows = []
        for rank in range(world):
            windows = PackedEvalWindows(data, 16, local, rank, world, micro, samples=range(36, 40))
            rows += [b.inputs for b in windows.batches(2)]
        return torch.cat(rows)

    one = evaluated(1, 8, 1)
    assert set((one // 100).unique().tolist()) <= {0, *range(36, 40)}  # 0: padding ids
    assert set((one[one > 0] // 100).tolist()) == set(range(36, 40))
    assert sorted(map(tuple, one.tolist())) == sorted(map(tuple, evaluated(2, 4, 1).tolist())) \
        == sorted(map(tuple, evaluated(4, 1, 2).tolist()))


# ------------------------------------------------- a tokenizer that adds BOS, as Llama 3's does
LLAMA3 = ("{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n{{ tools | tojson }}"
          "<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>"
          "{{ c['function'] | tojson }}</tool_call>{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
"""Llama 3's layout in a few lines: the template writes the BOS itself, and renders tools."""


@pytest.fixture(scope="module")
def bos(tmp_path_factory):
    """A tiny BPE tokenizer whose post-processor adds a BOS to every text, saved with a Llama-3
    style template ("llama3") and without one ("plain"), and with a tiny Llama config ("model")."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    bpe.train_from_iterator(["hello world, how are you today?", "the answer is forty two"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[
        ("<|begin_of_text|>", bpe.token_to_id("<|begin_of_text|>"))])
    dirs = {}
    for name, template in (("llama3", LLAMA3), ("plain", None), ("model", LLAMA3)):
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
        tok.chat_template = template
        dirs[name] = tmp_path_factory.mktemp(name)
        tok.save_pretrained(dirs[name])
    AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=320, max_position_embeddings=64
                         ).save_pretrained(dirs["model"])
    return dirs, AutoTokenizer.from_pretrained(dirs["llama3"], local_files_only=True)


def _trl_prompt_completion(tok, prompt, completion):
    """TRL's prompt/completion sample: prompt + completion + EOS tokenized as ``tok(text)`` does
    (special tokens added), the loss counting what follows the tokenized prompt."""
    ids = tok(prompt + completion + tok.eos_token)["input_ids"]
    before = len(tok(prompt)["input_ids"])
    return ids, [0] * before + [1] * (len(ids) - before)


def test_text_and_plain_prompt_completion_start_with_the_bos_the_tokenizer_adds(tmp_path, bos):
    dirs, tok = bos
    docs = ["hello world", "how are you today?"]
    data = _prepare(tmp_path, [{"text": d} for d in docs], "--data.tokenizer", str(dirs["llama3"]))
    assert data.tokens.tolist() == sum((tok(d + tok.eos_token)["input_ids"] for d in docs), [])  # TRL's rule
    assert data.tokens.tolist().count(tok.bos_token_id) == 2  # one per document
    rows = [{"prompt": "the answer is", "completion": " forty two"}, {"prompt": "", "completion": "hello"}]
    for name in ("llama3", "plain"):  # a template is no matter for plain strings
        data = _prepare(tmp_path, rows, "--data.tokenizer", str(dirs[name]), name=f"{name}.tokens")
        for i, row in enumerate(rows):
            ids, mask = _trl_prompt_completion(tok, row["prompt"], row["completion"])
            assert _sample(data, i) == (ids, [0] + mask[1:]) and ids[0] == tok.bos_token_id


def test_a_chat_keeps_exactly_one_bos(tmp_path, bos):
    dirs, tok = bos
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the answer"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "forty two"}]
    # The template writes the BOS and the tokenizer adds one too: apply_chat_template keeps one.
    data = _prepare(tmp_path, [{"messages": chat}, {"prompt": chat[:3], "completion": chat[3:]}],
                    "--data.tokenizer", str(dirs["llama3"]))
    want = list(tok.apply_chat_template(chat)["input_ids"])
    assert _sample(data, 0)[0] == _sample(data, 1)[0] == want and want.count(tok.bos_token_id) == 1
    assert _counted_text(tok, data, 0)[1] == "the answer<|eot_id|>forty two<|eot_id|>"
    assert _counted_text(tok, data, 1)[1] == "forty two<|eot_id|>"
    # mfsdp's own template writes none: the sample starts as tok(text) starts it.
    data = _prepare(tmp_path, [{"messages": chat}], "--data.tokenizer", str(dirs["plain"]), name="plain.tokens")
    assert _sample(data, 0)[0] == tok(render_chat(chat, False, tok.eos_token))["input_ids"]
    assert _sample(data, 0)[0].count(tok.bos_token_id) == 1


def test_sharegpt_and_alpaca_rows_are_the_chats_they_describe(tmp_path, bos):
    dirs, tok = bos
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello\nworld"},
            {"role": "assistant", "content": "forty two"}]
    sharegpt = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hello\nworld"},
                                  {"from": "gpt", "value": "forty two"}]}
    alpaca = {"instruction": "hello", "input": "world", "output": "forty two", "system": "be brief"}
    rows = [{"messages": chat}, sharegpt, alpaca, {"prompt": "p", "completion": "c"}]  # formats mixed
    for flags in (["--data.tokenizer", str(dirs["llama3"])], []):
        data = _prepare(tmp_path, rows, *flags, name=f"{len(flags)}.tokens")
        assert _sample(data, 0) == _sample(data, 1) == _sample(data, 2)
    assert _sample(data, 0) == _expected([(_b("<|system|>\nbe brief\n<|user|>\nhello\nworld\n<|assistant|>\n"), False),
                                          (_b("forty two"), True), ([EOS], True)])
    data = _prepare(tmp_path, rows[:3], "--data.tokenizer", str(dirs["llama3"]), name="hf.tokens")
    assert _sample(data, 1)[0] == list(tok.apply_chat_template(chat)["input_ids"])
    assert _counted_text(tok, data, 2)[1] == "forty two<|eot_id|>"
    history = {"instruction": "again", "output": "two", "history": [["hello", "forty"]]}
    data = _prepare(tmp_path, [history, {"messages": [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "forty"},
        {"role": "user", "content": "again"}, {"role": "assistant", "content": "two"}]}], name="h.tokens")
    assert _sample(data, 0) == _sample(data, 1)


TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
CALL = {"name": "add", "arguments": {"a": 40, "b": 2}}


def test_tool_calls_count_and_tool_results_do_not(tmp_path, bos):
    dirs, tok = bos
    chat = [{"role": "user", "content": "what is forty plus two?"},
            {"role": "assistant", "tool_calls": [{"type": "function", "function": CALL}]},
            {"role": "tool", "content": "42"}, {"role": "assistant", "content": "forty two"}]
    sharegpt = {"conversations": [{"from": "human", "value": chat[0]["content"]},
                                  {"from": "function_call", "value": json.dumps(CALL)},
                                  {"from": "observation", "value": "42"}, {"from": "gpt", "value": "forty two"}],
                "tools": json.dumps(TOOLS)}  # LLaMA-Factory gives the tools as a JSON string
    data = _prepare(tmp_path, [{"messages": chat, "tools": TOOLS}, sharegpt], "--data.tokenizer", str(dirs["llama3"]))
    assert _sample(data, 0) == _sample(data, 1)
    whole = tok.apply_chat_template(chat, tools=TOOLS, tokenize=False)
    assert _sample(data, 0)[0] == list(tok.apply_chat_template(chat, tools=TOOLS)["input_ids"])
    assert _counted_text(tok, data, 0) == (whole, f"<tool_call>{json.dumps(CALL)}</tool_call><|eot_id|>"
                                                  "forty two<|eot_id|>")
    data = _prepare(tmp_path, [{"messages": chat, "tools": TOOLS}], name="bytes.tokens")  # mfsdp's template
    ids, mask = _sample(data, 0)
    counted = ByteTokenizer().decode([t for t, m in zip(ids, mask) if m])
    assert ByteTokenizer().decode(ids).startswith(f"<|tools|>\n{json.dumps(TOOLS)}\n<|user|>\n")
    assert counted == f"<|tool_call|>{json.dumps(CALL)}forty two" and "<|tool|>\n42\n" in ByteTokenizer().decode(ids)


# ---------------------------------------------------------- samples longer than a window
def test_training_says_how_many_samples_a_window_cuts(tmp_path):
    from mfsdp.data.packing import cut_counts, cut_note

    data = _synthetic(tmp_path, [3, 20, 16, 17])
    assert cut_counts(data.sample_lengths, 16) == (2, 4 + 1)  # the rule prepare-data --data.max_len counts by
    assert PackedSampler(data, 16, 1, 0, 1).truncated == 2
    assert cut_note(data, 16) == (
        f"mfsdp train: 2 of 4 samples in {data.path} are longer than --data.seq_len 16 and are cut to it, "
        "dropping 5 of 56 tokens (the longest sample has 20); raise --data.seq_len to keep them whole, or cut "
        "them when preparing (`mfsdp prepare-data ... --data.max_len N`) to make it explicit")
    assert cut_note(data, 20) is None  # nothing cut: nothing said
    stream = TokenFile(write_token_file(tmp_path / "t", torch.arange(100), 257, "bytes"))
    assert cut_note(stream, 16) is None  # a stream's windows are drawn across documents by design


# ------------------------------------------------------- a token file made by another tokenizer
def test_an_hf_model_refuses_a_token_file_of_another_tokenizer(tmp_path, bos, hf):
    from mfsdp.data.identity import check_tokenizer
    from mfsdp.data.tokenizer import HuggingFaceTokenizer
    from mfsdp.train.run.resolve import load_config
    from mfsdp.train.run.preflight import check_run

    dirs, _ = bos
    model = str(dirs["model"])
    source = _rows(tmp_path / "chats.jsonl", [CHAT])

    def check(path):
        cfg = load_config(["--model.hf", model, "--data.path", str(path), "--data.packing", "false"])
        return check_run(cfg, 1, "cpu", lambda: TokenFile(path, model_hf=model))

    byte_file = tmp_path / "data" / "x.tokens"
    assert cli_main(["prepare-data", source, str(byte_file)]) == 0  # no --model.hf: bytes
    with pytest.raises(DataError) as err:
        check(byte_file)
    assert str(err.value) == (
        f"{byte_file} was tokenized by the byte tokenizer (vocabulary 257), not by the tokenizer of --model.hf "
        f"{model} (vocabulary 297), so its ids mean other text to the model; tokenize the data with it: "
        f"`mfsdp prepare-data INPUT {byte_file} --model.hf {model}`")
    with pytest.raises(DataError, match=f"`mfsdp prepare-data stdlib data/stdlib.tokens --model.hf {model}` and "
                                        "pass --data.path data/stdlib.tokens"):
        check_tokenizer(TokenFile(byte_file), model, "stdlib")  # the demo corpus is bytes too
    other = _prepare(tmp_path, [CHAT], "--data.tokenizer", str(hf[0]["chatml"]), name="other.tokens")
    with pytest.raises(DataError, match=f"was tokenized by the tokenizer {other.tokenizer} "):
        check(other.path)
    pair_rows = tmp_path / "pairs.jsonl"  # a preference pair file is held to the same rule
    pair_rows.write_text(json.dumps({"prompt": "hi there", "chosen": " yes", "rejected": " no"}) + "\n")
    pairs = tmp_path / "data" / "pairs.tokens"
    assert cli_main(["prepare-data", str(pair_rows), str(pairs), "--data.tokenizer", str(hf[0]["chatml"])]) == 0
    assert TokenFile(pairs).is_pairs
    with pytest.raises(DataError, match=f"{pairs} was tokenized by the tokenizer {other.tokenizer} "):
        check(pairs)
    # The model's tokenizer, or the same one saved elsewhere: the fingerprint is its content.
    for tokenizer in (model, str(dirs["llama3"])):
        ours = _prepare(tmp_path, [CHAT], "--data.tokenizer", tokenizer, name="ours.tokens")
        assert ours.fingerprint == HuggingFaceTokenizer(model).fingerprint != other.fingerprint
        assert check(ours.path).data.fingerprint == ours.fingerprint
    # Files written before files recorded a fingerprint: a byte-level one is refused, others pass.
    old = TokenFile(write_token_file(tmp_path / "old", torch.arange(10), 257, "bytes"))
    assert old.fingerprint is None
    with pytest.raises(DataError, match="was tokenized by the byte tokenizer"):
        check_tokenizer(old, model, str(old.path))
    check_tokenizer(TokenFile(write_token_file(tmp_path / "old2", torch.arange(10), 300, "/some/dir")), model, "x")
    (tmp_path / "config_only").mkdir()
    (dirs["model"] / "config.json").rename(tmp_path / "config_only" / "config.json")
    try:  # a directory with no tokenizer files: the vocabulary-size check alone, as before
        check_tokenizer(TokenFile(byte_file), str(tmp_path / "config_only"), str(byte_file))
    finally:
        (tmp_path / "config_only" / "config.json").rename(dirs["model"] / "config.json")

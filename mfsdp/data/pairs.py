"""Preference pairs: TRL's preference rows as the token ids trl 1.16's ``DPOTrainer`` builds.

The rows, in TRL's formats:

- explicit prompt: ``{"prompt": ..., "chosen": ..., "rejected": ...}``, three strings, or three
  lists of messages (conversational: the prompt's turns, then each answer's turns);
- implicit prompt: ``{"chosen": ..., "rejected": ...}``, two whole conversations (or texts) that
  open alike; the shared opening is the prompt, as trl's ``extract_prompt`` finds it.

The ids are trl's (``DPOTrainer._prepare_dataset``): a text is tokenized as ``tokenizer(text)``
(its BOS too), each text answer ending with the EOS text unless it already does; a conversation
goes through the chat template, the prompt alone with the generation prompt, prompt and answer
without it. Each prompt + answer is tokenized whole, and the prompt's ids are the tokens both
share with the tokenized prompt, so they are the same for both answers; each answer is the rest
of its sequence. ``max_len`` keeps the first ``max_len`` tokens of each prompt + answer and drops a
pair whose prompt alone fills it, as trl's ``max_length`` (its default ``keep_start``). Two
differences, both where trl would fail: a tokenizer without a chat template renders conversations
with mfsdp's (``mfsdp.data.template``), and a pair with an empty prompt or answer is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from mfsdp.data.readers import located
from mfsdp.data.rows import read_messages, read_tools, require_answer
from mfsdp.data.token_file import DataError, write_token_file
from mfsdp.data.tokenizer import require_eos_text

ANSWERS = ("chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    """A prompt and its two answers: three strings, or three tuples of messages."""

    prompt: str | tuple[dict, ...]
    chosen: str | tuple[dict, ...]
    rejected: str | tuple[dict, ...]
    tools: tuple[dict, ...] | None = None
    """The function schemas a conversation may call, for the chat template; None for none."""


def read_pair(row: dict) -> Pair:
    """A preference row as the pair it describes, checked."""
    missing = [key for key in ANSWERS if key not in row]
    if missing:
        keys = ", ".join(map(repr, row)) or "none"
        raise DataError(f"a preference row needs 'chosen' and 'rejected' (its keys: {keys}); add "
                        f"{' and '.join(map(repr, missing))}, or drop the row")
    parts = (row["prompt"], row["chosen"], row["rejected"]) if "prompt" in row else shared_prompt(row)
    kinds = {type(part) for part in parts}
    if kinds == {str}:
        for name, answer in zip(ANSWERS, parts[1:]):
            if not answer.strip():
                raise DataError(f"the {name} answer is empty; give the answer, or drop the row")
        return Pair(*parts)
    if kinds != {list}:
        raise DataError("'prompt', 'chosen' and 'rejected' must all be strings or all be lists of messages, "
                        f"not {', '.join(type(part).__name__ for part in parts)}")
    answers = [read_messages(answer, name) for name, answer in zip(ANSWERS, parts[1:])]
    for name, turns in zip(ANSWERS, answers):
        require_answer(turns, 0, f"the {name} answer has no assistant turn with content; give the answer, "
                                 "or drop the row")
    return Pair(read_messages(parts[0], "prompt"), *answers, read_tools(row))


def shared_prompt(row: dict) -> tuple:
    """(prompt, chosen, rejected) of an implicit-prompt row, as trl's ``extract_prompt`` splits it:
    at the first turn (or character) where the two part, a text's space before it going to the
    answers; where neither parts from the other, before the last turn of the shorter."""
    chosen, rejected = row["chosen"], row["rejected"]
    if not isinstance(chosen, (str, list)) or type(chosen) is not type(rejected):
        raise DataError("without a 'prompt', 'chosen' and 'rejected' must both be whole conversations (lists of "
                        f"messages) or both texts, not {type(chosen).__name__} and {type(rejected).__name__}")
    shorter = min(len(chosen), len(rejected))
    at = next((i for i in range(shorter) if chosen[i] != rejected[i]), None)
    at = shorter - 1 if at is None else at - (at > 0 and chosen[at - 1] == " ")
    if at <= 0:
        raise DataError("'chosen' and 'rejected' share no opening turn, and without a 'prompt' their shared "
                        "opening is the prompt; add the 'prompt' field, or fix the row")
    return chosen[:at], chosen[at:], rejected[at:]


def encode_pair(tokenizer, pair: Pair) -> tuple[list[int], list[int], list[int]]:
    """The ids of the pair's prompt, chosen answer and rejected answer, as trl's."""
    chat = not isinstance(pair.prompt, str)
    if chat:
        tools = list(pair.tools) if pair.tools else None
        texts = [tokenizer.render_chat(list(pair.prompt), True, tools)] + [
            tokenizer.render_chat(list(pair.prompt + answer), False, tools) for answer in (pair.chosen, pair.rejected)]
    else:
        eos = require_eos_text(tokenizer)
        texts = [pair.prompt] + [pair.prompt + answer + ("" if answer.endswith(eos) else eos)
                                 for answer in (pair.chosen, pair.rejected)]
    prompt, *sequences = (tokenizer.encode_spans(text, [], chat=chat)[0].tolist() for text in texts)
    shared = min(_common_prefix(prompt, ids) for ids in sequences)
    chosen, rejected = (ids[shared:] for ids in sequences)
    empty = "prompt" if not shared else "chosen answer" if not chosen else "rejected answer" if not rejected else None
    if empty:
        raise DataError(f"the {empty} gives no token of its own (it is empty, or its tokens merge with those "
                        "around it); give it text, or drop the row")
    return prompt[:shared], chosen, rejected


def _common_prefix(ids: list[int], other: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))


def prepare_pairs(source: Path, rows: Iterable[tuple[str, dict]], out: str | Path, tokenizer,
                  max_len: int | None) -> dict:
    """Write the pairs of ``rows`` ((where, row) each) as a version-3 token file; what was written."""
    ids, segments, sizes = [], [], []
    same = dropped = truncated = cut = 0
    for where, row in rows:
        prompt, chosen, rejected = located(where, lambda: encode_pair(tokenizer, read_pair(row)))
        if max_len is not None:  # each prompt + answer keeps its first max_len tokens
            if len(prompt) >= max_len:
                dropped += 1
                continue
            room = max_len - len(prompt)
            over = max(len(chosen) - room, 0) + max(len(rejected) - room, 0)
            truncated, cut = truncated + (over > 0), cut + over
            chosen, rejected = chosen[:room], rejected[:room]
        same += chosen == rejected
        size = torch.tensor([len(prompt), len(chosen), len(rejected)])
        ids.append(torch.tensor(prompt + chosen + rejected, dtype=torch.int64))
        segments.append(torch.repeat_interleave(torch.arange(3, dtype=torch.uint8), size))
        sizes.append(size)
    if not ids:
        raise DataError(f"every pair of {source} has a prompt of --data.max_len {max_len} tokens or more, which "
                        "trl's max_length drops; raise --data.max_len" if dropped else f"{source} holds no rows")
    lengths = torch.stack(sizes).sum(1)
    tokens, parts = torch.cat(ids), torch.stack(sizes).sum(0).tolist()
    write_token_file(out, tokens, tokenizer.vocab_size, tokenizer.name, sample_starts=torch.cumsum(lengths, 0) - lengths,
                     segments=torch.cat(segments), fingerprint=tokenizer.fingerprint)
    return {"format": "preference", "pairs": len(ids), "tokens": tokens.numel(), "parts": parts, "same": same,
            "dropped": dropped, "truncated": truncated, "cut_tokens": cut, "max_len": max_len,
            "vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.name, "path": str(out)}

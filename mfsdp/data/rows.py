"""What a JSONL row of fine-tuning data says: its format, checked, as a sample to encode.

Three formats, read from the first row unless forced:

- ``text``: ``{"text": ...}``, plain documents (pretraining data, a token stream);
- ``prompt_completion``: ``{"prompt": ..., "completion": ...}``, both strings, or both lists
  of messages (TRL's conversational prompt/completion);
- ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI/HF chat).

Roles are ``system``, ``user`` and ``assistant`` only: other roles (``tool``, ``function``,
``ipython``) are refused, because every chat template renders them differently and their
masking (is a tool result an answer?) has no one right answer; rewrite them as user turns.
Only ``role`` and ``content`` (a string) of a message are used. A row whose answer is empty
(a blank completion, or no assistant turn with content) is refused: it would train on nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mfsdp.data.token_file import DataError

FORMATS = ("text", "prompt_completion", "messages")
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class PromptCompletion:
    """A plain-string prompt and its completion: the loss counts the completion."""

    prompt: str
    completion: str


@dataclass(frozen=True)
class Conversation:
    """Chat turns; the loss counts the assistant turns from ``answers_from`` on."""

    messages: tuple[dict, ...]
    """``{"role": ..., "content": ...}`` dicts, roles among ``ROLES``."""
    answers_from: int = 0
    """The first turn whose assistant answers count: 0 for a chat, the prompt's length for a
    conversational prompt/completion (whose prompt may hold assistant turns of its own)."""


def parse_line(line: str) -> dict:
    """One JSONL line as a JSON object, or a DataError saying what is wrong with it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"invalid JSON ({err}); fix the line") from None
    if not isinstance(row, dict):
        raise DataError(f"a row must be a JSON object, not {type(row).__name__}; fix the line")
    return row


def detect_format(row: dict, text_key: str = "text") -> str:
    """The format a (first) row is in, from its keys."""
    if "messages" in row:
        return "messages"
    if "prompt" in row or "completion" in row:
        return "prompt_completion"
    if text_key in row:
        return "text"
    keys = ", ".join(map(repr, row)) or "none"
    raise DataError(f"a row in none of the formats (its keys: {keys}); give it a {text_key!r} "
                    "field, 'prompt' and 'completion', or 'messages', or pass --text-key FIELD "
                    "for text under another key")


def read_text(row: dict, text_key: str = "text") -> str:
    text = row.get(text_key)
    if not isinstance(text, str):
        raise DataError(f"a text row needs a string {text_key!r} field; fix the row, or pass "
                        "--text-key FIELD (or --format) if the file is in another format")
    return text


def read_sample(row: dict, fmt: str) -> PromptCompletion | Conversation:
    """A ``prompt_completion`` or ``messages`` row as the sample it describes."""
    if fmt == "messages":
        if "messages" not in row:
            raise DataError(_wrong_format(row, fmt))
        messages = _messages(row["messages"], "messages")
        _require_answer(messages, 0, "the conversation has no assistant turn with content; "
                                     "add the answer, or drop the row")
        return Conversation(messages)
    if "prompt" not in row or "completion" not in row:
        raise DataError(_wrong_format(row, fmt))
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            raise DataError("the completion is empty; give the answer, or drop the row")
        return PromptCompletion(prompt, completion)
    if isinstance(prompt, list) and isinstance(completion, list):
        turns = _messages(prompt, "prompt") + _messages(completion, "completion")
        _require_answer(turns, len(prompt), "the completion has no assistant turn with "
                                            "content; give the answer, or drop the row")
        return Conversation(turns, answers_from=len(prompt))
    raise DataError("'prompt' and 'completion' must both be strings or both be lists of "
                    f"messages, not {type(prompt).__name__} and {type(completion).__name__}")


def _wrong_format(row: dict, fmt: str) -> str:
    keys = ", ".join(map(repr, row)) or "none"
    want = "'messages'" if fmt == "messages" else "'prompt' and 'completion'"
    return (f"a {fmt} row needs {want} (its keys: {keys}); fix the row, or pass --format if "
            "the first row does not show the file's format")


def _messages(value, field: str) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{field!r} must be a non-empty list of messages; fix the row")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DataError(f"{field} message {i} must be an object with a string 'content'; "
                            "fix the row")
        role = message.get("role")
        if role not in ROLES:
            raise DataError(f"{field} message {i} has role {role!r}; mfsdp trains on system, "
                            "user and assistant turns only, so rewrite it as one of those or "
                            "drop it")
        out.append({"role": role, "content": message["content"]})
    return tuple(out)


def _require_answer(messages: tuple[dict, ...], first: int, problem: str) -> None:
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages[first:]):
        raise DataError(problem)

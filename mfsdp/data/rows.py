"""What a row of fine-tuning data says: its format, checked, as a sample to encode.

The formats, read from each row's keys unless forced:

- ``text``: ``{"text": ...}``, plain documents (pretraining data, a token stream);
- ``prompt_completion``: ``{"prompt": ..., "completion": ...}``, both strings, or both lists
  of messages (TRL's conversational prompt/completion);
- ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI/HF chat);
- ``sharegpt`` and ``alpaca``, as Axolotl and LLaMA-Factory read them (``mfsdp.data.row_formats``);
- ``preference``: ``{"chosen": ..., "rejected": ...}``, with or without a ``prompt``, TRL's
  preference pairs (``mfsdp.data.pairs``).

A file holds documents, samples or preference pairs: the first row decides which, and every row
of a file of samples may be in any sample format. Roles are ``system``, ``user``, ``assistant``
and ``tool``; an assistant message may carry ``tool_calls`` and a row a ``tools`` list of function schemas,
which go to the chat template as ``apply_chat_template(tools=...)`` takes them. The loss counts
assistant turns, tool calls too; tool results are prompts. Other roles (``function``,
``ipython``) are refused, because every chat template names them differently. A row whose answer
is empty (a blank completion, or no assistant turn with content or a tool call) is refused: it
would train on nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mfsdp.data.row_formats import alpaca_messages, sharegpt_messages
from mfsdp.data.token_file import DataError

FORMATS = ("text", "prompt_completion", "messages", "sharegpt", "alpaca", "preference")
ROLES = ("system", "user", "assistant", "tool")
ACCEPTED = ("a 'text' field (or --data.text_key FIELD), 'prompt' and 'completion', 'messages' (role and "
            "content), ShareGPT 'conversations' (from and value), Alpaca 'instruction' and 'output', or "
            "'chosen' and 'rejected' (a preference pair)")
"""The formats a row may be in, as an error lists them."""
_KEYS = {"prompt_completion": ("prompt", "completion"), "messages": ("messages",),
         "sharegpt": ("conversations",), "alpaca": ("instruction", "output")}


@dataclass(frozen=True)
class PromptCompletion:
    """A plain-string prompt and its completion: the loss counts the completion."""

    prompt: str
    completion: str


@dataclass(frozen=True)
class Conversation:
    """Chat turns; the loss counts the assistant turns from ``answers_from`` on."""

    messages: tuple[dict, ...]
    """``{"role": ..., "content": ...}`` dicts, roles among ``ROLES`` (an assistant's may have
    ``tool_calls``, a tool's ``tool_call_id`` and ``name``)."""
    answers_from: int = 0
    """The first turn whose assistant answers count: 0 for a chat, the prompt's length for a
    conversational prompt/completion (whose prompt may hold assistant turns of its own)."""
    tools: tuple[dict, ...] | None = None
    """The function schemas the conversation may call, for the chat template; None for none."""


def detect_format(row: dict, text_key: str = "text") -> str:
    """The format a row is in, from its keys."""
    for key, fmt in (("chosen", "preference"), ("rejected", "preference"), ("messages", "messages"),
                     ("conversations", "sharegpt"), ("instruction", "alpaca"), ("prompt", "prompt_completion"), ("completion", "prompt_completion"), (text_key, "text")):
        if key in row:
            return fmt
    keys = ", ".join(map(repr, row)) or "none"
    raise DataError(f"a row in none of the formats (its keys: {keys}); give it {ACCEPTED}")


def read_text(row: dict, text_key: str = "text") -> str:
    text = row.get(text_key)
    if not isinstance(text, str):
        raise DataError(f"a text row needs a string {text_key!r} field; fix the row, or pass "
                        "--data.text_key FIELD (or --data.format) if the file is in another format")
    return text


def read_sample(row: dict, fmt: str, forced: bool = True) -> PromptCompletion | Conversation:
    """A row of a sample format as the sample it describes; ``forced``: --data.format gave ``fmt``."""
    if not all(key in row for key in _KEYS[fmt]):
        raise DataError(_wrong_format(row, fmt, forced))
    if fmt in ("messages", "sharegpt", "alpaca"):
        messages = (row["messages"] if fmt == "messages" else
                    sharegpt_messages(row) if fmt == "sharegpt" else alpaca_messages(row))
        messages = read_messages(messages, "messages" if fmt != "sharegpt" else "conversations")
        require_answer(messages, 0, "the conversation has no assistant turn with content; "
                                    "add the answer, or drop the row")
        return Conversation(messages, tools=read_tools(row))
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            raise DataError("the completion is empty; give the answer, or drop the row")
        return PromptCompletion(prompt, completion)
    if isinstance(prompt, list) and isinstance(completion, list):
        turns = read_messages(prompt, "prompt") + read_messages(completion, "completion")
        require_answer(turns, len(prompt), "the completion has no assistant turn with "
                                           "content; give the answer, or drop the row")
        return Conversation(turns, answers_from=len(prompt), tools=read_tools(row))
    raise DataError("'prompt' and 'completion' must both be strings or both be lists of "
                    f"messages, not {type(prompt).__name__} and {type(completion).__name__}")


def _wrong_format(row: dict, fmt: str, forced: bool) -> str:
    keys = ", ".join(map(repr, row)) or "none"
    want = " and ".join(map(repr, _KEYS[fmt]))
    article = "an" if fmt[0] in "aeiou" else "a"
    return (f"{article} {fmt} row needs {want} (its keys: {keys}); fix the row"
            + (", or drop --data.format to read each row's format from its keys" if forced else ""))


def read_messages(value, field: str) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{field!r} must be a non-empty list of messages; fix the row")
    return tuple(_message(message, field, i) for i, message in enumerate(value))


def _message(message, field: str, i: int) -> dict:
    """One message, checked, with only the keys a chat template reads."""
    role = message.get("role") if isinstance(message, dict) else None
    calls = message.get("tool_calls") if role == "assistant" else None
    if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
        raise DataError(f"{field} message {i}: 'tool_calls' must be a list of objects; fix the row")
    content = message.get("content") if isinstance(message, dict) else None
    if content is None and calls:
        content = ""  # a turn that only calls tools
    if not isinstance(content, str):
        raise DataError(f"{field} message {i} must be an object with a string 'content'; "
                        "fix the row")
    if role not in ROLES:
        raise DataError(f"{field} message {i} has role {role!r}; mfsdp trains on system, user, "
                        "assistant and tool turns only, so rewrite it as one of those or drop it")
    out = {"role": role, "content": content}
    if calls:
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name") if role == "tool" else ():
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def read_tools(row: dict) -> tuple[dict, ...] | None:
    """The row's ``tools`` list (LLaMA-Factory's ShareGPT rows give it as a JSON string)."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as err:
            raise DataError(f"'tools' is a string but not JSON ({err}); fix the row") from None
    if tools in (None, []):
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError("'tools' must be a list of function schemas (objects); fix the row")
    return tuple(tools)


def require_answer(messages: tuple[dict, ...], first: int, problem: str) -> None:
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls"))
               for m in messages[first:]):
        raise DataError(problem)

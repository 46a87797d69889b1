"""mfsdp's own chat template, for tokenizers that bring none (the byte tokenizer, and Hugging
Face tokenizers whose directory has no ``chat_template``).

A conversation renders as::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}<eos>...

Each turn opens with its role in ``<|...|>`` and a newline. A system, user or tool turn closes
with a newline, an assistant turn with the tokenizer's end-of-sequence token, which is what the
model learns to emit when its answer is done (so generation stops there). An assistant turn's
tool calls follow its content, one ``<|tool_call|>`` line of JSON (name and arguments) each; the
tools a conversation may call come first, as a ``<|tools|>`` turn of their JSON schemas. The
generation prompt is ``<|assistant|>\\n``. It is kept this small on purpose: the markers are plain
text, so any tokenizer encodes them, and the same template is easy to write again at inference.
"""

from __future__ import annotations

import json

GENERATION_PROMPT = "<|assistant|>\n"


def render_chat(messages: list[dict], add_generation_prompt: bool, eos: str,
                tools: list | None = None) -> str:
    """The conversation as text, ``eos`` standing for the end-of-sequence token."""
    head = f"<|tools|>\n{json.dumps(tools, ensure_ascii=False)}\n" if tools else ""
    turns = [f"<|{m['role']}|>\n{_body(m)}" + (eos if m["role"] == "assistant" else "\n") for m in messages]
    return head + "".join(turns) + (GENERATION_PROMPT if add_generation_prompt else "")


def _body(message: dict) -> str:
    """The content, then a line per tool call."""
    calls = [call.get("function", call) for call in message.get("tool_calls") or ()]
    lines = [f"<|tool_call|>{json.dumps(call, ensure_ascii=False)}" for call in calls]
    return "\n".join(([message["content"]] if message["content"] else []) + lines)

"""mfsdp's own chat template, for tokenizers that bring none (the byte tokenizer, and Hugging
Face tokenizers whose directory has no ``chat_template``).

A conversation renders as::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}<eos>...

Each turn opens with its role in ``<|...|>`` and a newline. A system or user turn closes with a
newline, an assistant turn with the tokenizer's end-of-sequence token, which is what the model
learns to emit when its answer is done (so generation stops there). The generation prompt
is ``<|assistant|>\\n``. It is kept this small on purpose: the markers are plain text, so any
tokenizer encodes them, and the same template is easy to write again at inference time.
"""

from __future__ import annotations

GENERATION_PROMPT = "<|assistant|>\n"


def render_chat(messages: list[dict], add_generation_prompt: bool, eos: str) -> str:
    """The conversation as text, ``eos`` standing for the end-of-sequence token."""
    turns = [f"<|{m['role']}|>\n{m['content']}" + (eos if m["role"] == "assistant" else "\n")
             for m in messages]
    return "".join(turns) + (GENERATION_PROMPT if add_generation_prompt else "")

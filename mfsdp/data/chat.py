"""A sample as token ids and a loss mask: which tokens the fine-tuning loss counts.

The loss counts the answer: a plain completion and the end-of-sequence token after it, or
each assistant turn through the marker its template closes it with (so the model learns to
stop), tool calls included. System, user and tool turns never count; ``train_on_prompt``
counts every token. The first token of a sample is never counted, since it is no one's target.
A plain prompt and completion start with the special tokens the tokenizer adds to a text (BOS),
a conversation as its template renders it (``mfsdp.data.tokenizer``).

Assistant turns are found for any Hugging Face chat template by rendering incrementally:
the conversation before turn k with the generation prompt, and through turn k, must each be
a prefix of the whole conversation's text; the characters between the two are turn k's
answer. A template that renders earlier turns differently once later ones follow breaks
this and is refused (``train_on_prompt`` needs no spans, so it still works). The ids are
those of the whole text tokenized once; the spans only mark which of them count.
"""

from __future__ import annotations

import torch

from mfsdp.data.rows import Conversation, PromptCompletion
from mfsdp.data.token_file import DataError
from mfsdp.data.tokenizer import require_eos_text


def encode_sample(tokenizer, sample: PromptCompletion | Conversation,
                  train_on_prompt: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The sample's ids (int64) and loss mask (bool), one value per token."""
    _refuse_end_marker(tokenizer, sample)
    chat = not isinstance(sample, PromptCompletion)
    if not chat:
        text = sample.prompt + sample.completion + require_eos_text(tokenizer)
        spans = [(len(sample.prompt), len(text))]
    elif train_on_prompt:
        text, spans = tokenizer.render_chat(list(sample.messages), False, _tools(sample)), []
    else:
        text, spans = answer_spans(tokenizer, sample)
    ids, mask = tokenizer.encode_spans(text, [(0, len(text))] if train_on_prompt else spans, chat=chat)
    mask[:1] = False
    return ids, mask


def answer_spans(tokenizer, sample: Conversation) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character span of each counted assistant turn."""
    messages, tools = list(sample.messages), _tools(sample)
    whole = tokenizer.render_chat(messages, False, tools)
    spans = []
    for k in range(sample.answers_from, len(messages)):
        if messages[k]["role"] != "assistant":
            continue
        before = tokenizer.render_chat(messages[:k], True, tools)
        through = tokenizer.render_chat(messages[:k + 1], False, tools)
        if not (through.startswith(before) and whole.startswith(through)):
            raise DataError(
                f"{tokenizer.template_name} breaks the prefix property: the conversation "
                f"rendered up to message {k} (an assistant turn) is not a prefix of the whole "
                "conversation's text, so its answer tokens cannot be found; use a template "
                "that renders earlier turns the same whatever follows, or pass --data.train_on_prompt true")
        spans.append((len(before), len(through)))
    return whole, spans


def _tools(sample: Conversation) -> list[dict] | None:
    return list(sample.tools) if sample.tools else None


def _refuse_end_marker(tokenizer, sample: PromptCompletion | Conversation) -> None:
    texts = ([sample.prompt, sample.completion] if isinstance(sample, PromptCompletion)
             else [m["content"] for m in sample.messages])
    if tokenizer.eos_text is not None and any(tokenizer.eos_text in t for t in texts):
        raise DataError(f"the row holds the end-of-sequence text {tokenizer.eos_text!r}, which "
                        "would end its turn early; remove it from the row")

"""Tokenizers: bytes by default, or a local Hugging Face tokenizer directory.

The byte tokenizer needs no files and no downloads: every UTF-8 byte is its own id
(0-255), and one extra id marks the end of a document. It suits the tiny demo model,
whose vocabulary of 512 leaves room to spare.

For prompt/answer and chat data each tokenizer also renders a conversation to text
(``render_chat``: the directory's chat template, else mfsdp's own, ``mfsdp.data.template``)
and encodes a text with the character spans the loss counts (``encode_spans``), so that
the ids are those of the whole text tokenized once.

A text is encoded as ``tokenizer(text)`` encodes it, with the special tokens the tokenizer adds
around every text (Llama 3's adds a BOS), as TRL does for text and prompt/completion rows. A
conversation rendered by the directory's own chat template is encoded without them, as
``apply_chat_template`` does: such a template writes its BOS itself, so a sample has one.
Each tokenizer has a ``fingerprint``, a hash of its vocabulary and special tokens, which token
files record so that a run can refuse a file another tokenizer made.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch

from mfsdp.data.template import render_chat
from mfsdp.data.token_file import DataError

BYTES = "bytes"


class ByteTokenizer:
    name = BYTES
    end_of_document = 256
    vocab_size = 257
    eos_text = "\uffff"
    """Stands for the end-of-document id in rendered text: a Unicode noncharacter, which
    text meant for interchange never holds (a row that does is refused)."""
    template_name = "mfsdp's chat template"
    fingerprint = hashlib.sha256(b"mfsdp bytes: ids 0-255 the UTF-8 bytes, 256 the end of a document"
                                 ).hexdigest()[:32]

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None) -> str:
        return render_chat(messages, add_generation_prompt, self.eos_text, tools)

    def encode_spans(self, text: str, spans: list[tuple[int, int]],
                     chat: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids of ``text`` and a bool mask, True for the bytes inside ``spans``. Bytes
        need no context, so each piece between span edges is encoded on its own."""
        cuts = sorted({0, len(text), *(edge for span in spans for edge in span)})
        ids, mask = [], []
        for a, b in zip(cuts, cuts[1:]):
            pieces = [self.encode(part) for part in text[a:b].split(self.eos_text)]
            piece = sum((p + [self.end_of_document] for p in pieces[:-1]), []) + pieces[-1]
            ids += piece
            mask += [any(s <= a and b <= e for s, e in spans)] * len(piece)
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool)


class HuggingFaceTokenizer:
    """A tokenizer saved with ``save_pretrained``, loaded from disk only (no downloads)."""

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer  # heavy and optional, so imported here
        except ImportError as err:
            raise DataError("--data.tokenizer PATH needs the `transformers` package; install it "
                            "with `pip install transformers`, or use the byte tokenizer") from err
        if not Path(path).is_dir():
            raise DataError(f"tokenizer directory {path} does not exist; pass a local directory "
                            "written by save_pretrained")
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.name = str(Path(path).resolve())
        self.vocab_size = len(self._tok)
        self.end_of_document = self._tok.eos_token_id
        self.eos_text = self._tok.eos_token  # None when the tokenizer has none
        self.template_name = (f"the chat template of {path}" if self._tok.chat_template is not None
                              else f"mfsdp's chat template ({path} has none)")
        self._frame = _frame(self._tok)

    @functools.cached_property
    def fingerprint(self) -> str:
        """32 hex digits of a hash of the vocabulary (added tokens too), the special tokens and the ids
        added around a text, which token files record: equal for two tokenizers that encode every text alike."""
        vocab = sorted(self._tok.get_vocab().items(), key=lambda item: (item[1], item[0]))
        special = sorted((str(k), str(v)) for k, v in self._tok.special_tokens_map.items())
        blob = json.dumps([vocab, special, sorted(self._tok.all_special_tokens), self._frame], ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def _adds_special(self, chat: bool) -> bool:
        """Whether a text gets the tokenizer's special tokens: not one its own template rendered."""
        return not (chat and self._tok.chat_template is not None)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """The ids of ``text`` as ``tokenizer(text)`` gives them; ``chat``: ``text`` is a rendered
        conversation."""
        return self._tok.encode(text, add_special_tokens=self._adds_special(chat))

    def special_ids(self) -> dict:
        """The begin- and end-of-sequence ids, as a Hugging Face ``config.json`` names them."""
        return {"bos_token_id": self._tok.bos_token_id, "eos_token_id": self._tok.eos_token_id}

    def save(self, out: Path) -> None:
        """The tokenizer's files (its chat template too) into the model directory ``out``."""
        self._tok.save_pretrained(out)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None) -> str:
        if self._tok.chat_template is None:
            return render_chat(messages, add_generation_prompt, require_eos_text(self), tools)
        try:
            return self._tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as err:  # a user's Jinja template can raise anything
            raise DataError(f"{self.template_name} cannot render this conversation "
                            f"({type(err).__name__}: {err}); fix the row or the template") from None

    def encode_spans(self, text: str, spans: list[tuple[int, int]],
                     chat: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids of ``text`` tokenized once (as ``encode``) and a bool mask, True for each token
        whose characters overlap a span (a token that straddles a span's edge counts). Of the
        special tokens the tokenizer adds, those before the text never count, those after it
        count as its last token does (an EOS it appends ends the answer)."""
        if not self._tok.is_fast:
            raise DataError(f"tokenizer {self.name} is a slow (Python) tokenizer, which gives no "
                            "character offsets to find the answer tokens; save it with its "
                            "tokenizer.json (a fast tokenizer)")
        special = self._adds_special(chat)
        encoded = self._tok(text, add_special_tokens=special, return_offsets_mapping=True)
        ids = torch.tensor(encoded["input_ids"], dtype=torch.int64)
        offsets = torch.tensor(encoded["offset_mapping"], dtype=torch.int64).view(-1, 2)
        begin, end = offsets[:, 0], torch.maximum(offsets[:, 1], offsets[:, 0] + 1)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        for a, b in spans:
            mask |= (begin < b) & (end > a)
        before, after = (len(self._frame[0]), len(self._frame[1])) if special else (0, 0)
        mask[:before] = False
        if after and ids.numel() > before + after:
            mask[-after:] = mask[-after - 1]
        return ids, mask


def _frame(tok) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds before and after every text (``add_special_tokens``)."""
    bare, full = tok.encode("a", add_special_tokens=False), tok.encode("a")
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    return [], []


def require_eos_text(tokenizer) -> str:
    """The text of the token that closes an answer, or a DataError when there is none."""
    if tokenizer.eos_text is None:
        raise DataError(f"tokenizer {tokenizer.name} has no end-of-sequence token to close an "
                        "answer with; set eos_token in its tokenizer_config.json")
    return tokenizer.eos_text


def load_tokenizer(name: str | None) -> ByteTokenizer | HuggingFaceTokenizer:
    """``"bytes"`` (or None) for the byte tokenizer, otherwise a local tokenizer directory."""
    return ByteTokenizer() if name in (None, "", BYTES) else HuggingFaceTokenizer(name)

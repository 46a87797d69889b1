"""Tokenizers: bytes by default, or a local Hugging Face tokenizer directory.

The byte tokenizer needs no files and no downloads: every UTF-8 byte is its own id
(0-255), and one extra id marks the end of a document. It suits the tiny demo model,
whose vocabulary of 512 leaves room to spare.
"""

from __future__ import annotations

from pathlib import Path

from mfsdp.data.token_file import DataError

BYTES = "bytes"


class ByteTokenizer:
    name = BYTES
    end_of_document = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A tokenizer saved with ``save_pretrained``, loaded from disk only (no downloads)."""

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer  # heavy and optional, so imported here
        except ImportError as err:
            raise DataError("--tokenizer PATH needs the `transformers` package; install it "
                            "with `pip install transformers`, or use the byte tokenizer") from err
        if not Path(path).is_dir():
            raise DataError(f"tokenizer directory {path} does not exist; pass a local directory "
                            "written by save_pretrained")
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.name = str(Path(path).resolve())
        self.vocab_size = len(self._tok)
        self.end_of_document = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(name: str | None) -> ByteTokenizer | HuggingFaceTokenizer:
    """``"bytes"`` (or None) for the byte tokenizer, otherwise a local tokenizer directory."""
    if name in (None, "", BYTES):
        return ByteTokenizer()
    return HuggingFaceTokenizer(name)

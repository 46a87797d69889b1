"""Whether a token file was made by the tokenizer of the model a run trains.

A file records its tokenizer's fingerprint (``mfsdp.data.tokenizer``). A ``--model.hf DIR`` run
whose directory holds a tokenizer refuses a file with another fingerprint: its ids would mean
other text to the model, and the vocabulary-size check alone passes a byte-level file (257 ids)
for any larger model. A file written before files recorded a fingerprint is refused only when it
is byte-level, which no Hugging Face tokenizer is; otherwise the vocabulary-size check decides.
A directory without tokenizer files (a config or weights only) is checked by vocabulary size.
"""

from __future__ import annotations

from pathlib import Path

from mfsdp.data.prepare import STDLIB
from mfsdp.data.token_file import DataError, TokenFile, fresh_token_path, prepare_command
from mfsdp.data.tokenizer import BYTES, HuggingFaceTokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""A directory holds a tokenizer when it has one of these (what ``save_pretrained`` writes)."""


def model_tokenizer(model_hf: str | None) -> HuggingFaceTokenizer | None:
    """The tokenizer of the ``--model.hf`` directory, or None when it has none."""
    if model_hf is None or not any((Path(model_hf) / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return HuggingFaceTokenizer(model_hf)
    except DataError:
        raise
    except Exception as err:  # a broken tokenizer file can raise anything
        raise DataError(f"--model.hf {model_hf}: its tokenizer does not load ({type(err).__name__}: "
                        f"{err}); fix or remove its tokenizer files") from None


def check_tokenizer(data: TokenFile, model_hf: str | None, data_path: str) -> None:
    """Raise a DataError naming the fix when ``data`` (the run's ``--data.path`` ``data_path``)
    was made by another tokenizer than the ``--model.hf`` directory's."""
    if model_hf is None or (data.fingerprint is None and data.tokenizer != BYTES):
        return
    tokenizer = model_tokenizer(model_hf)
    if tokenizer is None or data.fingerprint == tokenizer.fingerprint:
        return
    who = "the byte tokenizer" if data.tokenizer == BYTES else f"the tokenizer {data.tokenizer}"
    if data.tokenizer == tokenizer.name:
        who = f"an earlier version of the tokenizer in {data.tokenizer}"
    source, out, then = "INPUT", data.path, ""
    if data_path == STDLIB:  # the demo corpus: a token file of its own for this tokenizer
        source, out = STDLIB, fresh_token_path(STDLIB)
        then = f" and pass --data.path {out}"
    raise DataError(f"{data.path} was tokenized by {who} (vocabulary {data.vocab_size}), not by the tokenizer "
                    f"of --model.hf {model_hf} (vocabulary {tokenizer.vocab_size}), so its ids mean other "
                    f"text to the model; tokenize the data with it: "
                    f"{prepare_command(source, out, model_hf)}{then}")

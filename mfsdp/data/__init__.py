"""Token files, tokenizers and the deterministic batch sampler used by ``mfsdp train``."""

from mfsdp.data.heldout import EvalWindows, held_out_tokens
from mfsdp.data.prepare import STDLIB, RowOptions, prepare, prepare_stdlib_corpus
from mfsdp.data.sampler import Batch, WindowSampler
from mfsdp.data.token_file import DataError, TokenFile, write_token_file
from mfsdp.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["Batch", "ByteTokenizer", "DataError", "EvalWindows", "RowOptions", "STDLIB", "TokenFile",
           "WindowSampler", "held_out_tokens", "load_tokenizer", "prepare", "prepare_stdlib_corpus", "write_token_file"]

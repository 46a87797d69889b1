"""Token files, tokenizers and the deterministic batch samplers used by ``mfsdp train``."""

from mfsdp.data.heldout import EvalWindows, PackedEvalWindows, PairEvalWindows, held_out_samples, held_out_tokens
from mfsdp.data.packing import PackedSampler, PackedWindows
from mfsdp.data.pair_packing import PairWindows
from mfsdp.data.prepare import STDLIB, RowOptions, prepare, prepare_stdlib_corpus
from mfsdp.data.sampler import Batch, WindowSampler
from mfsdp.data.token_file import DataError, TokenFile, write_token_file
from mfsdp.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["Batch", "ByteTokenizer", "DataError", "EvalWindows", "PackedEvalWindows", "PackedSampler",
           "PackedWindows", "PairEvalWindows", "PairWindows", "RowOptions", "STDLIB", "TokenFile", "WindowSampler", "held_out_samples",
           "held_out_tokens", "load_tokenizer", "prepare", "prepare_stdlib_corpus", "write_token_file"]

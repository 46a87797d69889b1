"""A random Hugging Face model directory and a small BPE tokenizer with a chat template: what a
fine-tuning run needs when nothing may be downloaded (``make finetune-demo``, the CPU tests and
``benchmarks/make_hf_dir.py``, which also writes synthetic chat rows).

``SHAPES`` names the architecture of a public checkpoint (its config.json values; the weights are
random) or ``tiny``. The tokenizer is byte-level BPE trained on a few synthetic sentences with
ChatML turns; its ids are a prefix of every shape's vocabulary, so token files made with it fit the
model.
"""

from __future__ import annotations

import random
from pathlib import Path

SHAPES = {
    # meta-llama/Meta-Llama-3-8B config.json
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=8192),
    # meta-llama/Llama-3.2-1B config.json, without its llama3 rope scaling
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192, head_dim=64),
    # Qwen/Qwen2.5-7B config.json: qkv bias, untied head, rope theta 1e6
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=32768),
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512, rope_theta=10000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=512),
}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("the a one two three four five six seven eight nine ten plus minus is what how many apples "
         "oranges answer question please tell me hello world today good thanks").split()


def model_config(shape: str):
    """The ``transformers`` config of ``shape``."""
    import transformers

    values = dict(SHAPES[shape])
    return transformers.AutoConfig.for_model(values.pop("model_type"), **values)


def make_model(out: Path, shape: str, seed: int = 0, init: str = "hf") -> None:
    """config.json and bf16 safetensors of a randomly initialised model of ``shape`` (drawn on the
    GPU when there is one): "hf" draws every matrix from N(0, initializer_range) as ``from_config``
    does; "bundled" then scales the two projections that write into the residual stream (o_proj,
    down_proj) by 1/sqrt(2 n_layers), as the bundled Llama's ``init_weights`` draws them, so a run of
    the directory and one of the preset multiply values of the same distributions."""
    import torch
    import transformers
    from packaging.version import Version

    config = model_config(shape)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype_key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, **{dtype_key: torch.bfloat16})
    if init == "bundled":
        scale = (2 * config.num_hidden_layers) ** -0.5
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    param.mul_(scale)
    model.save_pretrained(out, max_shard_size="5GB")


def make_tokenizer(out: Path, vocab: int = 1000) -> None:
    """A byte-level BPE tokenizer with ChatML turns and its chat template, saved into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    text = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(500)]
    bpe.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(out)

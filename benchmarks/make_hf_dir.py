"""A random Hugging Face model directory, a small BPE tokenizer with a chat template, and synthetic
chat rows: what a fine-tuning run needs, built here because nothing may be downloaded.

    python benchmarks/make_hf_dir.py OUT_DIR --shape llama3-8b [--rows ROWS.jsonl --n-rows 2000]

``--shape`` names the architecture of a public checkpoint (its config.json values; the weights are
random, drawn on the GPU when there is one) or ``tiny`` for tests. The tokenizer is byte-level BPE
trained on a few synthetic sentences with ChatML turns; its ids are a prefix of the model's
vocabulary, so token files made with it fit the model.
"""

from __future__ import annotations

import argparse
import json
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


def make_model(out: Path, shape: str, seed: int = 0, init: str = "hf") -> None:
    """config.json and bf16 safetensors of a randomly initialised model of ``shape``: "hf" draws
    every matrix from N(0, initializer_range) as ``from_config`` does; "bundled" then scales the two
    projections that write into the residual stream (o_proj, down_proj) by 1/sqrt(2 n_layers), as
    the bundled Llama's ``init_weights`` draws them, so a run of the directory and one of the preset
    multiply values of the same distributions (a GPU at its power cap clocks by the data)."""
    import torch
    import transformers

    values = dict(SHAPES[shape])
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
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


def make_rows(path: Path, n: int, seed: int = 0) -> None:
    """``n`` synthetic chat rows (a system turn sometimes, then one or two user/assistant turns)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": "You add small numbers."}] if rng.random() < 0.3 else []
        for _ in range(rng.choice((1, 2))):
            a, b = rng.randrange(10), rng.randrange(10)
            messages += [{"role": "user", "content": f"what is {a} plus {b}?"},
                         {"role": "assistant", "content": f"{a} plus {b} is {a + b}. " * rng.randrange(1, 20)}]
        rows.append({"messages": messages})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--no-weights", action="store_true", help="config.json only (trains from random init)")
    p.add_argument("--init", choices=("hf", "bundled"), default="hf",
                   help="hf: transformers' init; bundled: the residual-writing projections scaled as the preset's")
    p.add_argument("--rows", type=Path, help="also write synthetic chat rows here")
    p.add_argument("--n-rows", type=int, default=2000)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.no_weights:
        import transformers

        values = dict(SHAPES[args.shape])
        transformers.AutoConfig.for_model(values.pop("model_type"), **values).save_pretrained(args.out)
    else:
        make_model(args.out, args.shape, init=args.init)
    make_tokenizer(args.out)
    if args.rows:
        make_rows(args.rows, args.n_rows)
    print(f"wrote {args.out} ({args.shape}{', no weights' if args.no_weights else ''})"
          + (f" and {args.n_rows} chat rows in {args.rows}" if args.rows else ""))


if __name__ == "__main__":
    main()

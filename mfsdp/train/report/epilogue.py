"""What a run does after its last step: the loss curve, the Hugging Face export and a text sample."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from mfsdp.data import DataError, TokenFile
from mfsdp.data.tokenizer import load_tokenizer
from mfsdp.train.run.config import RunConfig
from mfsdp.train.command.errors import CheckpointError, agree
from mfsdp.train.report.sample import generate_text


def finish(cfg: RunConfig, model, data: TokenFile, last: int, stopped: bool, device: torch.device, log,
           objective) -> None:
    """Plot, then (unless a signal stopped the run) export and sample; collective."""
    out_dir = Path(cfg.train.out_dir)
    checkpoint = out_dir / "checkpoints" / f"step_{last}"
    if dist.get_rank() == 0:
        from mfsdp.train.report.plotting import needs_matplotlib, plot_loss  # matplotlib is slow to import

        metrics = out_dir / "metrics.jsonl"
        plot = plot_loss(metrics, out_dir / "loss.png", objective) or needs_matplotlib("the PNG")
        log(f"metrics: {metrics}\nloss curve: {plot}\ncheckpoint: {checkpoint}")
    if stopped:
        log(f"stopped by signal after step {last}; continue with --resume")
        return
    if cfg.train.export_hf:
        export_hf(checkpoint, out_dir / "hf", log, cfg.weights_dtype(device.type))  # an fp32 run exports fp32
    if cfg.train.sample_tokens:
        print_sample(cfg, model, data, device, log)


def export_hf(checkpoint: Path, out: Path, log, dtype: torch.dtype) -> None:
    """--train.export_hf: rank 0 writes the final checkpoint to ``out`` in ``dtype`` (read from disk, one
    tensor at a time, as `mfsdp export` does; a LoRA run's as a PEFT adapter, or merged) while the
    others wait; a failure stops them all."""
    problem = None
    if dist.get_rank() == 0:
        from mfsdp.hf.export import exported_line
        from mfsdp.train.export import ExportError, export_hf as export

        try:
            log(exported_line(export(checkpoint, out, dtype)))
        except (ExportError, CheckpointError) as err:
            problem = (f"exporting {checkpoint} to Hugging Face failed: {err} (the checkpoint is intact; "
                       f"retry with `mfsdp export {checkpoint} OUT_DIR`)")
    agree(problem)


CHAT_PROMPT = "Write a short greeting."
"""The user turn of a fine-tuned (chat) model's sample."""


def print_sample(cfg: RunConfig, model, data: TokenFile, device: torch.device, log) -> None:
    """A few hundred tokens continuing a short prompt: for a model trained on samples, the answer
    to a user turn rendered by the data's chat template; a collective (the model is sharded)."""
    try:
        tokenizer = load_tokenizer(data.tokenizer)
        chat = data.num_samples is not None
        prompt = tokenizer.render_chat([{"role": "user", "content": CHAT_PROMPT}], True) if chat else "def "
    except DataError as err:
        log(f"(no text sample: {err})")
        return
    text = generate_text(model, tokenizer, prompt, cfg.train.sample_tokens, max_context=cfg.data.seq_len,
                         device=device, seed=cfg.train.seed, stop_id=tokenizer.end_of_document if chat else None,
                         chat=chat)
    if chat:  # the answer, up to the end of its turn
        log(f"\n--- sample (temperature 0.8, {tokenizer.template_name}; user: {CHAT_PROMPT!r}) ---\n"
            f"{text}\n--- end ---")
    else:
        log(f"\n--- sample (temperature 0.8, prompt {prompt!r}) ---\n{prompt}{text}\n--- end ---")

"""`mfsdp train --peft.method lora` on a GPU, compiled, bf16: the adapters train, the checkpoint holds
only them, and in deterministic mode a resume from step 4 equals the uninterrupted run bit for bit
(skipped without CUDA). The tiny preset, 8 steps: two launches of well under a minute on an H200."""

import pytest
import torch

from test_gpu_train_resume import mfsdp_train, side_by_side
from test_train_e2e import loss_and_grad_norm, stopped_copy
from test_train_e2e import corpus  # noqa: F401  (a fixture: the small token file)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LORA = ["--peft.method", "lora", "--peft.lora_r", "8", "--parallel.compile", "true", "--train.lr", "1e-3"]


def test_a_compiled_lora_run_trains_saves_adapters_and_resumes_bit_for_bit(corpus, tmp_path):
    from mfsdp.train.checkpoint import CheckpointMeta
    from torch.distributed.checkpoint import FileSystemReader

    out = tmp_path / "whole"
    said = mfsdp_train(corpus, out, *LORA)
    assert "LoRA r 8, alpha 32, 7 linears × 4 blocks" in said, said
    losses = loss_and_grad_norm(out)
    assert losses[8][0] < losses[1][0], losses
    keys = FileSystemReader(str(out / "checkpoints" / "step_8")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A" in k or ".lora_B" in k for k in model_keys), model_keys
    assert CheckpointMeta.read(out / "checkpoints" / "step_8").peft["r"] == 8
    resumed = stopped_copy(out, 4, tmp_path / "resumed")
    mfsdp_train(corpus, resumed, *LORA, "--resume")
    got = loss_and_grad_norm(resumed)
    assert {s: got[s] for s in range(5, 9)} == {s: losses[s] for s in range(5, 9)}, side_by_side(losses, got)

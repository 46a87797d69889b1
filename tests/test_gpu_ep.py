"""Expert parallelism on CUDA with NCCL (skipped without 2 GPUs): the bundled route's parity cases of
``tests/test_ep_parity.py`` (forced routing: a rank that sends nothing to another, an expert no token
chose) against the full-batch reference, fp32."""

from __future__ import annotations

import pytest
import torch

from test_ep_parity import check, ep_parity

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (expert parallelism over NCCL)")]


@pytest.mark.parametrize("placements,forced", [("zero3", True), ("zero2", False)])
def test_ep2_on_two_gpus(cuda_world, placements, forced):
    check(cuda_world.run(ep_parity, timeout=300, ep=2, placements=placements, forced=forced, device="cuda"))

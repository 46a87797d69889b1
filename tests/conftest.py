import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist import World  # noqa: E402


@pytest.fixture(scope="session")
def world():
    """world(n) returns a persistent gloo world of n ranks, started on first use."""
    cache: dict[int, World] = {}

    def get(n: int) -> World:
        if n not in cache:
            cache[n] = World(n)
        return cache[n]

    yield get
    for w in cache.values():
        w.close()


@pytest.fixture(scope="module")
def cuda_world():
    """A NCCL world over up to two GPUs, one per test module (GPU tests only)."""
    import torch

    w = World(min(2, torch.cuda.device_count()), backend="nccl")
    yield w
    w.close()

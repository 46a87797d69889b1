"""``mfsdp.kernels.to_fp32``: bit for bit ``Tensor.to(torch.float32)``, through the Triton kernel on
CUDA (the lean optimizer step's upcast) and through ``Tensor.to`` elsewhere."""

import pytest
import torch

from mfsdp import kernels


def widen_matches_torch(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for n in (1, 4095, 4096, 3 * 4096 + 17):
            x = (torch.randn(n, generator=gen) * 1e3).to(dtype)
            specials = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40], dtype=dtype)
            x[: min(n, 5)] = specials[: min(n, 5)]
            x = x.to(device)
            got, expected = kernels.to_fp32(x), x.to(torch.float32)
            assert got.dtype == torch.float32 and got.shape == x.shape
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (dtype, n)


def test_to_fp32_on_cpu_is_tensor_to():
    widen_matches_torch("cpu")
    x = torch.arange(6.0).view(2, 3).t()  # not contiguous, and fp32 already: Tensor.to's answer
    assert torch.equal(kernels.to_fp32(x), x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_to_fp32_bits_equal_tensor_to(monkeypatch):
    if kernels.available("cuda"):  # the kernel, not the fallback
        monkeypatch.setattr(torch.Tensor, "to", lambda *a, **k: pytest.fail("Tensor.to ran"), raising=True)
        x = torch.ones(3, dtype=torch.bfloat16, device="cuda")
        out = kernels.to_fp32(x)
        monkeypatch.undo()
        assert out.dtype == torch.float32
    widen_matches_torch("cuda")

"""The chunked dot products: exact against float64, and the scratch bound the DDP measurement states."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_simigrad.measurement import _dots


def _pair(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(numel)
    a = torch.randn(numel, generator=gen)
    return a.to(dtype), (0.3 * a + torch.randn(numel, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_products_equal_float64_over_several_chunks(dtype: torch.dtype) -> None:
    a, b = _pair(3 * _dots.CPU_CHUNK + 5, dtype)
    x, y = a.double(), b.double()
    expected = torch.stack([x @ x, x @ y, y @ y])
    rel = 1e-12 if dtype == torch.float64 else 2e-5  # CPU: float32 chunk products, summed in float64
    torch.testing.assert_close(_dots.gram(a, b), expected, rtol=rel, atol=0)
    torch.testing.assert_close(_dots.square(b), expected[2], rtol=rel, atol=0)
    total = b.clone()
    torch.testing.assert_close(_dots.gram_and_add_(a, total), expected, rtol=rel, atol=0)
    assert torch.equal(total, b + a)  # the same addition plain accumulation does


class _LargestTemporary(TorchDispatchMode):
    """The largest tensor any op creates while active, in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:  # views and in-place results take no new memory
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_accelerator_scratch_is_bounded_whatever_the_bucket() -> None:
    # The accelerator path, run on the meta device: shapes and dtypes without data.
    a = torch.empty(10 * _dots.DEVICE_CHUNK + 3, device="meta")  # a 40 MiB float32 bucket
    b = torch.empty_like(a)
    with _LargestTemporary() as mode:
        assert _dots.gram(a, b).dtype == torch.float64
        _dots.square(a)
        _dots.gram_and_add_(a, b)
    assert mode.largest == _dots.DEVICE_CHUNK * 8  # one float64 chunk, 8 MiB, never the bucket
    assert _dots.scratch_bytes(torch.device("cuda")) == 2 * _dots.DEVICE_CHUNK * 8 == 16 * 2**20
    assert _dots.scratch_bytes(torch.device("cpu")) == 2 * 2**20

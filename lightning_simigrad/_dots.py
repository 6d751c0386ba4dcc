"""Dot products of two gradient pieces, read from memory once.

Both measurements reduce a pair of gradient tensors ``(a, b)`` to ``[a.a, a.b, b.b]``. Three separate
``torch.dot`` calls would stream each tensor from memory twice; cutting the pair into cache-sized
chunks lets the second and third products of each chunk read what the first left in cache (on the
development CPU: 4.1 ms instead of 6.6 ms for 11.5M float32 pairs). :func:`gram_and_add_` also adds
``a`` into ``b`` in the same pass. Each chunk's products are float32 (upcast from half precision),
summed in float64; on an accelerator, where bandwidth is ample, chunks are converted to float64 whole.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gram", "gram_and_add_", "square"]

_CPU_CHUNK = 1 << 18  # two float32 chunks of 1 MiB each stay in a core's cache
_DEVICE_CHUNK = 1 << 24


def _chunks(a: Tensor, b: Tensor):  # type: ignore[no-untyped-def]
    on_cpu = a.device.type == "cpu"
    chunk = _CPU_CHUNK if on_cpu else _DEVICE_CHUNK
    dtype = torch.float32 if on_cpu and a.dtype != torch.float64 else torch.float64
    a, b = a.view(-1), b.view(-1)
    for start in range(0, a.numel(), chunk):
        x, y = a[start : start + chunk], b[start : start + chunk]
        yield x, y, x.to(dtype), y.to(dtype)


def _products(x: Tensor, y: Tensor) -> Tensor:
    return torch.stack([torch.dot(x, x), torch.dot(x, y), torch.dot(y, y)])


def _total(parts: list[Tensor], device: torch.device) -> Tensor:
    if not parts:
        return torch.zeros(3, dtype=torch.float64, device=device)
    return torch.stack(parts).to(torch.float64).sum(dim=0)


def gram(a: Tensor, b: Tensor) -> Tensor:
    """``[a.a, a.b, b.b]`` as a float64 tensor of shape (3,) on ``a``'s device."""
    a, b = a.contiguous(), b.contiguous()
    return _total([_products(x, y) for _, _, x, y in _chunks(a, b)], a.device)


def gram_and_add_(a: Tensor, b: Tensor) -> Tensor:
    """``[a.a, a.b, b.b]`` of the inputs, then ``b += a`` in place, in one pass over memory."""
    if not (a.is_contiguous() and b.is_contiguous()):
        products = gram(a, b)
        b.add_(a)
        return products
    parts = []
    for raw_x, raw_y, x, y in _chunks(a, b):
        parts.append(_products(x, y))
        raw_y.add_(raw_x)  # the chunk is still in cache
    return _total(parts, a.device)


def square(x: Tensor) -> Tensor:
    """``x.x`` as a float64 scalar tensor, chunked like :func:`gram`."""
    x = x.contiguous()
    parts = [torch.dot(c, c) for _, _, c, _ in _chunks(x, x)]
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    return torch.stack(parts).to(torch.float64).sum()

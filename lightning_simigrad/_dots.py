"""The three dot products of two gradient pieces, read from memory once.

Both measurements reduce a pair of gradient tensors ``(a, b)`` to ``[a.a, a.b, b.b]``. Three separate
``torch.dot`` calls would stream ``b`` from memory twice and ``a`` twice; cutting the pair into
cache-sized chunks lets the second and third products of each chunk read what the first left in cache
(on the development CPU: 4.1 ms instead of 6.6 ms for 11.5M float32 pairs). Each chunk's products are
float32 (upcast from half precision), summed in float64; on an accelerator, where bandwidth is ample,
chunks are converted to float64 whole.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gram"]

_CPU_CHUNK = 1 << 18  # two float32 chunks of 1 MiB each stay in a core's cache
_DEVICE_CHUNK = 1 << 24


def gram(a: Tensor, b: Tensor) -> Tensor:
    """``[a.a, a.b, b.b]`` as a float64 tensor of shape (3,) on ``a``'s device."""
    a, b = a.reshape(-1), b.reshape(-1)
    on_cpu = a.device.type == "cpu"
    chunk = _CPU_CHUNK if on_cpu else _DEVICE_CHUNK
    dtype = torch.float32 if on_cpu and a.dtype != torch.float64 else torch.float64
    parts = []
    for start in range(0, a.numel(), chunk):
        x, y = a[start : start + chunk].to(dtype), b[start : start + chunk].to(dtype)
        parts.append(torch.stack([torch.dot(x, x), torch.dot(x, y), torch.dot(y, y)]))
    if not parts:
        return torch.zeros(3, dtype=torch.float64, device=a.device)
    return torch.stack(parts).to(torch.float64).sum(dim=0)

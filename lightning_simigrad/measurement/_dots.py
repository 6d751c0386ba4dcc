r"""Dot products of gradient pieces: one bucket in bounded chunks, or every parameter's in O(1) ops.

The measurements reduce pairs of gradient pieces ``(a, b)`` to ``[a.a, a.b, b.b]``.

**One large piece** (a DDP bucket, :func:`gram`, :func:`square`). Three separate ``torch.dot`` calls
would stream each tensor from memory twice; cutting the pair into cache-sized chunks lets the second and
third products of each chunk read what the first left in cache (on the development CPU: 4.1 ms instead
of 6.6 ms for 11.5M float32 pairs). The number of ops grows with the bucket's size, not with the number
of parameter tensors in it.

**Many parameter tensors** (one process, :func:`gram_and_add_all_`). A Python loop over the parameters
issues a handful of ops per tensor (ResNet-50 has 161 tensors, BERT-Large about 400): kernel launches
and Python calls that cost more than the arithmetic. Instead, three fused multi-tensor (``foreach``) ops
do it whatever the number of tensors: the norms of every ``a`` and ``b``, ``b += a``, and the norms of
the sums; the cross term follows from :math:`|a+b|^2 = |a|^2 + 2\,a \cdot b + |b|^2`. Those are four passes
over the halves' memory where plain accumulation makes one (the addition). On CPU, where there are no kernel
launches to save and a pass over a large gradient costs more than the ops, the pairs of at least
:data:`STREAM_AT_LEAST` elements are instead streamed like one large piece (:func:`gram_and_add_`: per chunk, three
dots and the addition on what sits in cache): one pass over memory, the products direct rather than by
difference, a few ops per chunk; the small tensors still take the fused ops.

Precision: the norms accumulate in float32 (``dtype=torch.float32`` also for bf16/fp16 gradients, which
are read without a converted copy; float64 for float64 gradients) and are squared and summed in float64
(:func:`wide_dtype`). Each
norm is then within a few float32 ulps (:math:`\epsilon = 2^{-24}`) of exact, and so is the rounded sum
:math:`a + b` itself; the cross term recovered by difference is off by about
:math:`4 \epsilon (|a|^2 + |b|^2)`, so the cosine similarity by about
:math:`2 \epsilon (|a|^2 + |b|^2) / (|a||b|)`: :math:`\approx 5 \cdot 10^{-7}` for halves of equal norm, and a
few :math:`10^{-6}` for tensors of hundreds of thousands of elements, whose float32 norms round more (the CPU's
streamed dots stay within :math:`10^{-7}`); far below the sampling noise of any similarity
(``tests/measurement/test_dots.py`` checks both against float64). For
bf16/fp16 gradients the sum :math:`a + b` is rounded to the gradient's own precision (as plain
accumulation rounds it); the squared norm of that rounding, unbiased and summed over many elements,
stays below :math:`10^{-3}` of the similarity for any gradient of more than a few hundred elements.

Scratch memory, per call of :func:`gram`, :func:`gram_and_add_` or :func:`square` (chunks are converted
one at a time and released before the next, so the bound does not grow with the tensors):

* CPU: chunk products in float32 (half precision upcast, float32 read in place), summed in float64.
  At most two float32 chunks of :data:`CPU_CHUNK` elements (2 MiB), only when upcasting.
* accelerators: chunks converted to :func:`wide_dtype` (float64; float32 on MPS, which has no float64).
  At most two converted chunks of :data:`DEVICE_CHUNK` elements (16 MiB), whatever the bucket's size.

:func:`gram_and_add_all_` takes three float32 numbers per tensor (no gradient-sized scratch).

All work is enqueued on the current stream, and every temporary is created and consumed there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_simigrad import _compat

__all__ = [
    "CPU_CHUNK",
    "DEVICE_CHUNK",
    "gram",
    "gram_and_add_",
    "HalfTensors",
    "gram_and_add_all_",
    "gram_of_sum",
    "norm_weights",
    "scratch_bytes",
    "square",
    "wide_dtype",
]

CPU_CHUNK = 1 << 18  # two float32 chunks of 1 MiB each stay in a core's cache
DEVICE_CHUNK = 1 << 20  # two float64 chunks of 8 MiB: the bound on the measurement's scratch per call


def wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype products are summed in on ``device``: float64, or float32 where there is no float64 (MPS).

    >>> wide_dtype(torch.device("cpu")), wide_dtype(torch.device("mps"))
    (torch.float64, torch.float32)
    """
    return torch.float32 if device.type == "mps" else torch.float64


def _plan(x: Tensor) -> tuple[int, torch.dtype]:
    if x.device.type == "cpu":
        return CPU_CHUNK, torch.float32 if x.dtype != torch.float64 else torch.float64
    return DEVICE_CHUNK, wide_dtype(x.device)


def scratch_bytes(device: torch.device) -> int:
    """The most temporary memory one call of the chunked functions takes on ``device`` (two converted chunks)."""
    if device.type == "cpu":
        return 2 * CPU_CHUNK * 4
    return 2 * DEVICE_CHUNK * torch.empty((), dtype=wide_dtype(device)).element_size()


def _chunked(a: Tensor, b: Tensor | None, add: bool, summed_rows: bool = False) -> Tensor:
    """The products of ``a`` (and ``b``) chunk by chunk; ``b += a`` chunk by chunk when ``add``.

    With ``summed_rows``, ``a`` is 2-D, ``(k, n)``, and its rows are summed into the first operand in the wide
    dtype, one chunk at a time, never in ``a``'s own precision.

    Each chunk costs its products (and addition) and nothing more: the chunks' views come from one ``split``
    each, operands already in the products' dtype are used as they are, and the products are stacked once at
    the end. Every further op per chunk would cost the host a few microseconds, tens of chunks per window.
    """
    chunk, dtype = _plan(a)
    firsts = a.split(chunk, dim=1) if summed_rows else a.view(-1).split(chunk)
    seconds = b.view(-1).split(chunk) if b is not None else None
    products: list[Tensor] = []
    for i, raw_x in enumerate(firsts):
        x = raw_x.sum(0, dtype=dtype) if summed_rows else _as(raw_x, dtype)
        if seconds is None:
            products.append(torch.dot(x, x))
        else:
            raw_y = seconds[i]
            y = _as(raw_y, dtype)
            products += (torch.dot(x, x), torch.dot(x, y), torch.dot(y, y))
            if add:
                raw_y.add_(raw_x)  # the chunk is still in cache
            del y
        del x  # released before the next chunk is converted: two converted chunks at most
    wide = wide_dtype(a.device)
    if not products:
        return torch.zeros((3,) if b is not None else (), dtype=wide, device=a.device)
    stacked = torch.stack(products).to(wide)
    return stacked.view(-1, 3).sum(dim=0) if b is not None else stacked.sum()


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype``, itself when it is already (no dispatch for a conversion that does nothing)."""
    return x if x.dtype == dtype else x.to(dtype)


def gram(a: Tensor, b: Tensor) -> Tensor:
    """``[a.a, a.b, b.b]`` as a float64 tensor of shape (3,) on ``a``'s device (float32 on MPS)."""
    return _chunked(a.contiguous(), b.contiguous(), add=False)


def gram_and_add_(a: Tensor, b: Tensor) -> Tensor:
    """``[a.a, a.b, b.b]`` of the inputs, then ``b += a`` in place, in one pass over memory."""
    if not (a.is_contiguous() and b.is_contiguous()):
        products = gram(a, b)
        b.add_(a)
        return products
    return _chunked(a, b, add=True)


def gram_of_sum(slices: Tensor, b: Tensor) -> Tensor:
    """``[u.u, u.b, b.b]`` where ``u`` is the sum of the rows of ``slices`` (``k x n``), summed in the wide dtype.

    Summing bf16/fp16 slices in their own precision would round ``u`` to 8 or 11 bits; here each chunk of
    ``u`` is summed in float32 or wider as it is used, within the same scratch bound as :func:`gram`.
    """
    return _chunked(slices.contiguous(), b.contiguous(), add=False, summed_rows=True)


def square(x: Tensor) -> Tensor:
    """``x.x`` as a float64 scalar tensor (float32 on MPS), chunked like :func:`gram`."""
    return _chunked(x.contiguous(), None, add=False)


class HalfTensors(NamedTuple):
    """A window's two halves' gradient tensors on one device: the pairs ``(a[i], b[i])`` of the parameters with a
    gradient in both, and the unpaired pieces whose partner is zero (a parameter with a gradient in one half only)."""

    a: Sequence[Tensor]
    b: Sequence[Tensor]
    a_only: Sequence[Tensor] = ()
    b_only: Sequence[Tensor] = ()


def gram_and_add_all_(
    a: Sequence[Tensor],
    b: Sequence[Tensor],
    a_only: Sequence[Tensor] = (),
    b_only: Sequence[Tensor] = (),
    weights: Tensor | None = None,
) -> Tensor:
    """``[s.s, s.r, r.r]`` over every pair ``(a[i], b[i])`` and the unpaired tensors, then ``b[i] += a[i]``.

    ``s`` is the concatenation of ``a`` and ``a_only``, ``r`` that of ``b`` and ``b_only``; ``a_only`` and
    ``b_only`` are pieces whose partner is zero (a parameter with a gradient in one half only). All tensors
    lie on one device. About fifteen ops whatever the number of tensors (on CPU, plus four per chunk of the large
    pairs: see the module docstring); returns a tensor of shape (3,) in :func:`wide_dtype`.

    ``weights``, when given, weighs each tensor's contribution to the products (one more op): a vector in
    :func:`wide_dtype` on the tensors' device, laid out by :func:`norm_weights`. Under FSDP2 a piece held
    alike by several ranks (a replicated mesh dimension) is weighed by one over their number, so that the
    ranks' products add up to the whole gradient's.
    """
    halves = HalfTensors(a, b, a_only, b_only)
    first = next((t for t in (*a, *a_only, *b, *b_only)), None)
    if first is not None and first.device.type == "cpu":
        streamed = [i for i, (x, y) in enumerate(zip(a, b)) if _streams(x, y)]
        if streamed:
            return _stream_large_pairs(halves, weights, streamed)
    return _fused_gram_and_add_all_(halves, weights)


# CPU: pairs of at least this many elements are streamed through the cache in chunks (`gram_and_add_`)
STREAM_AT_LEAST = CPU_CHUNK


def _streams(x: Tensor, y: Tensor) -> bool:
    return x.numel() >= STREAM_AT_LEAST and x.is_contiguous() and y.is_contiguous() and x.dtype == y.dtype


def _stream_large_pairs(halves: HalfTensors, weights: Tensor | None, streamed: list[int]) -> Tensor:
    """CPU: the large pairs one chunk at a time (three dots and the addition on what sits in cache), the rest through
    the fused ops; the same products and the same sums ``b += a`` as :func:`_fused_gram_and_add_all_`."""
    a, b, a_only, b_only = halves
    large = torch.stack([gram_and_add_(a[i], b[i]) for i in streamed])  # rows [a.a, a.b, b.b]: [s.s, s.r, r.r]
    chosen = set(streamed)
    rest = [i for i in range(len(a)) if i not in chosen]
    rest_weights = None
    if weights is not None:
        na, nao, nbo = len(a), len(a_only), len(b_only)
        pairs = weights[:na]
        large = large * pairs[streamed].unsqueeze(1)
        kept = pairs[rest]
        rest_weights = torch.cat([kept, weights[na : na + nao], kept, weights[2 * na + nao : 2 * na + nao + nbo], kept])
    the_rest = HalfTensors([a[i] for i in rest], [b[i] for i in rest], a_only, b_only)
    others = _fused_gram_and_add_all_(the_rest, rest_weights)
    return large.sum(0).to(others) + others


def _fused_gram_and_add_all_(halves: HalfTensors, weights: Tensor | None = None) -> Tensor:
    """:func:`gram_and_add_all_` in a constant number of fused multi-tensor ops."""
    a, b, a_only, b_only = halves
    first = next((t for t in (*a, *a_only, *b, *b_only)), None)
    if first is None:
        return torch.zeros(3, dtype=torch.float64)
    device = first.device
    wide = wide_dtype(device)
    pieces = [*a, *a_only, *b, *b_only]
    # float32 accumulation, or float64 where the gradients are float64 (a norm may only widen its input)
    norm_dtype = torch.float64 if any(t.dtype == torch.float64 for t in pieces) else torch.float32
    norms = _compat.foreach_norm(pieces, norm_dtype)
    if a:
        _compat.foreach_add_(list(b), list(a))  # the addition plain accumulation does, fused
        norms += _compat.foreach_norm(list(b), norm_dtype)
    squares = torch.stack(norms).to(wide).square()
    if weights is not None:
        squares = squares * weights
    na, nao, nb, nbo = len(a), len(a_only), len(b), len(b_only)
    ss = squares[: na + nao].sum()
    rr = squares[na + nao : na + nao + nb + nbo].sum()
    if a:  # s.r over the pairs: (|a + b|^2 - |a|^2 - |b|^2) / 2
        sr = 0.5 * (squares[-nb:].sum() - squares[:na].sum() - squares[na + nao : na + nao + nb].sum())
    else:
        sr = torch.zeros((), dtype=wide, device=device)
    return torch.stack([ss, sr, rr])


def norm_weights(pairs: Sequence[float], a_only: Sequence[float] = (), b_only: Sequence[float] = ()) -> list[float]:
    """The ``weights`` of :func:`gram_and_add_all_` in its layout, from one weight per pair and per unpaired tensor.

    A pair ``(a[i], b[i])`` is two halves of one gradient and has one weight, which also weighs their sum.

    >>> norm_weights([1.0, 0.5], [0.25], [2.0])
    [1.0, 0.5, 0.25, 1.0, 0.5, 2.0, 1.0, 0.5]
    """
    return [*pairs, *a_only, *pairs, *b_only, *pairs]

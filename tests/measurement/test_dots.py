"""The chunked dot products: exact against float64, and the scratch bound the DDP measurement states."""

import weakref

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


class _LiveTemporaries(TorchDispatchMode):
    """The most bytes of new tensors alive at once while active (views and in-place results excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                size = t.numel() * t.element_size()
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, size)
        return out

    def _free(self, size: int) -> None:
        self.live -= size


def test_accelerator_scratch_is_bounded_whatever_the_bucket() -> None:
    # The accelerator path, run on the meta device: shapes and dtypes without data.
    a = torch.empty(10 * _dots.DEVICE_CHUNK + 3, device="meta")  # a 40 MiB float32 bucket
    b = torch.empty_like(a)
    slices = torch.empty(4, a.numel(), device="meta", dtype=torch.bfloat16)  # W >= 4: group A's received slices
    with _LargestTemporary() as mode, _LiveTemporaries() as live:
        assert _dots.gram(a, b).dtype == torch.float64
        _dots.square(a)
        _dots.gram_and_add_(a, b)
        _dots.gram_of_sum(slices, b)
    assert mode.largest == _dots.DEVICE_CHUNK * 8  # one float64 chunk, 8 MiB, never the bucket
    # the documented bound holds for what is alive at once, not just for each tensor: two converted chunks
    assert _dots.DEVICE_CHUNK * 8 < live.peak <= _dots.scratch_bytes(torch.device("cuda")) + 4096
    assert _dots.scratch_bytes(torch.device("cuda")) == 2 * _dots.DEVICE_CHUNK * 8 == 16 * 2**20
    assert _dots.scratch_bytes(torch.device("cpu")) == 2 * 2**20


def test_mps_sums_in_float32_everywhere_else_float64() -> None:
    # MPS has no float64; the choice is made from the device alone, so it is tested without one
    assert _dots.wide_dtype(torch.device("mps")) == torch.float32
    assert _dots.wide_dtype(torch.device("cuda")) == _dots.wide_dtype(torch.device("cpu")) == torch.float64
    assert _dots.scratch_bytes(torch.device("mps")) == 2 * _dots.DEVICE_CHUNK * 4


def _halves(count: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(count)
    shapes = [(7, 13), (300,), (17, 5, 3), (1,)] * (count // 4)
    a = [torch.randn(shape, generator=gen) for shape in shapes]
    b = [0.4 * x + torch.randn(x.shape, generator=gen) for x in a]
    return [x.to(dtype) for x in a], [y.to(dtype) for y in b]


def _flat(tensors) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.cat([t.double().reshape(-1) for t in tensors]) if tensors else torch.zeros(0, dtype=torch.float64)


def _reference(a, b, a_only, b_only) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """[s.s, s.r, r.r] in float64: s = (a, a_only, 0), r = (b, 0, b_only)."""
    zeros_a, zeros_b = (torch.zeros(sum(t.numel() for t in ts), dtype=torch.float64) for ts in (a_only, b_only))
    s = torch.cat([_flat(a), _flat(a_only), zeros_b])
    r = torch.cat([_flat(b), zeros_a, _flat(b_only)])
    return torch.stack([s @ s, s @ r, r @ r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_parameters_at_once_match_float64(dtype: torch.dtype) -> None:
    a, b = _halves(200, dtype)
    a_only, b_only = [x.clone() for x in a[:3]], [y.clone() for y in b[:5]]
    pairs_a, pairs_b = a[3:], b[3:]
    expected = _reference(pairs_a, pairs_b, a_only, b_only)
    sums = [(x.double() + y.double()).to(dtype) for x, y in zip(pairs_a, pairs_b)]
    got = _dots.gram_and_add_all_(pairs_a, pairs_b, a_only, b_only)
    assert got.dtype == torch.float64
    similarity = float(got[1] / (got[0] * got[2]).sqrt())
    expected_similarity = float(expected[1] / (expected[0] * expected[2]).sqrt())
    # float32 norms: ~1e-6 in the similarity; bf16/fp16: the rounding of the sum a + b, well below 1e-3
    assert abs(similarity - expected_similarity) < (2e-6 if dtype == torch.float32 else 1e-3)
    torch.testing.assert_close(got[[0, 2]], expected[[0, 2]], rtol=1e-5, atol=0)
    assert all(torch.equal(y, z) for y, z in zip(pairs_b, sums))  # b += a, rounded like plain accumulation


def test_all_parameters_at_once_take_the_same_ops_for_4_or_200_tensors() -> None:
    counts = []
    for count in (4, 200):
        a, b = _halves(count, torch.float32)
        with _OpCount() as ops:
            _dots.gram_and_add_all_(a, b)
        counts.append(ops.count)
    assert counts[0] == counts[1] < 30, counts


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_slices_are_summed_in_float32_or_wider_not_in_their_own_precision() -> None:
    gen = torch.Generator().manual_seed(0)
    slices = torch.randn(4, 3 * _dots.CPU_CHUNK + 7, generator=gen).to(torch.bfloat16)
    b = (slices.double().sum(0) + torch.randn(slices.shape[1], generator=gen, dtype=torch.float64)).to(torch.bfloat16)
    u, y = slices.double().sum(0), b.double()
    expected = torch.stack([u @ u, u @ y, y @ y])
    torch.testing.assert_close(_dots.gram_of_sum(slices, b), expected, rtol=2e-5, atol=0)


@pytest.mark.parametrize("weighted", [False, True])
def test_on_cpu_large_pairs_stream_through_the_cache_with_the_same_sums_and_products(weighted: bool) -> None:
    """Pairs of at least STREAM_AT_LEAST elements take three dots and the addition chunk by chunk (one pass over
    memory instead of four); the sums are bitwise the fused path's and the products agree with float64."""
    g = torch.Generator().manual_seed(5)
    shapes = [(700, 1024), (3,), (2, _dots.STREAM_AT_LEAST + 7), (11,), (5, 5)]
    a = [torch.randn(s, generator=g) for s in shapes]
    b = [torch.randn(s, generator=g) for s in shapes]
    a_only, b_only = [torch.randn(300_000, generator=g)], [torch.randn(9, generator=g)]
    weights = None
    if weighted:
        per_pair = [1.0, 0.5, 0.25, 1.0, 0.5]
        weights = torch.tensor(_dots.norm_weights(per_pair, [0.5], [2.0]), dtype=torch.float64)
    scaled = [w**0.5 for w in (weights[: len(a)].tolist() if weighted else [1.0] * len(a))]
    expected = _reference(
        [x.double() * f for x, f in zip(a, scaled)],
        [y.double() * f for y, f in zip(b, scaled)],
        [t.double() * (0.5**0.5 if weighted else 1.0) for t in a_only],
        [t.double() * (2.0**0.5 if weighted else 1.0) for t in b_only],
    )
    fused_b = [y.clone() for y in b]
    fused = _dots._fused_gram_and_add_all_(_dots.HalfTensors(a, fused_b, a_only, b_only), weights)
    with _OpCount() as ops:
        got = _dots.gram_and_add_all_(a, b, a_only, b_only, weights)
    assert all(torch.equal(y, z) for y, z in zip(b, fused_b))  # the gradient the optimizer sees: bitwise the same
    # dots in float32 chunks summed in float64: the chunk's float32 rounding depends on the CPU's vector path
    # (1.5e-6 relative on one AMD EPYC host, under 1e-6 where the test was written): 1e-5, far below any defect
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    # the fused path recovers s.r by a difference of float32 norms, within a few 1e-6 of |s||r| at these sizes;
    # streamed, the dots are direct: two orders of magnitude closer
    scale = float((expected[0] * expected[2]).sqrt())
    assert abs(float(fused[1] - expected[1])) < 1e-5 * scale and abs(float(got[1] - expected[1])) < 1e-7 * scale
    chunks = sum(-(-a[i].numel() // _dots.CPU_CHUNK) for i in (0, 2))
    assert ops.count < 30 + 12 * chunks, ops.count  # a few ops per chunk of the large pairs, none per small tensor

"""Why the one-process measurement's floor sits where it does on CPU: torch's kernels for the three products.

    python benchmarks/dot_kernels.py                 # one thread, ~20 seconds
    python benchmarks/dot_kernels.py --threads 2

The window's end takes three float32 dot products over every gradient element (docs/measurement.md, "Where the
cost sits"). This times, on one pair of 4M-element tensors:

- the ways torch offers to take a dot product, on a 256K-element chunk held in cache and repeated 16 times (4M
  elements), beside a plain ``sum`` of as many elements: the sum is what a reduction over them costs, so the gap is
  the kernel, not the memory;
- the library's streamed window's end (:func:`_dots.gram_and_add_all_`: three dots and the join's addition per
  chunk) on tensors shaped as ``benchmarks/overhead.py``'s MLP, at chunk sizes 2^14..2^20, against the join's
  addition alone. The difference is what the products cost, the floor ``overhead.py`` prints.

Median wall and CPU milliseconds of 30 calls each. CPU time sums every thread, so more threads than one can show
more CPU than wall.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from overhead import _net  # beside this file

from lightning_simigrad import _compat
from lightning_simigrad.measurement import _dots

CHUNK = 1 << 18
REPEATS = 16  # chunks of CHUNK elements: 4M in all


def timed(fn: Callable[[], object], calls: int = 30) -> tuple[float, float]:
    """Median wall and CPU milliseconds of ``calls`` calls."""
    wall, cpu = [], []
    for _ in range(calls):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def kernels() -> None:
    x, y = torch.randn(CHUNK), torch.randn(CHUNK)
    pair = torch.stack([x, y])
    product = torch.empty(CHUNK)
    ways: dict[str, Callable[[], object]] = {
        "sum (one operand, no products)": lambda: x.sum(),
        "torch.dot": lambda: torch.dot(x, y),
        "torch.mv, 1 x n": lambda: torch.mv(x.view(1, -1), y),
        "torch.einsum('i,i->')": lambda: torch.einsum("i,i->", x, y),
        "torch.mul into a buffer, then sum": lambda: torch.mul(x, y, out=product).sum(),
        "2 x n Gram by mm (all three products)": lambda: pair @ pair.T,
    }
    print(f"in cache: {REPEATS} x {CHUNK:,} float32 elements per call")
    for name, way in ways.items():
        wall, cpu = timed(lambda way=way: [way() for _ in range(REPEATS)])
        rate = REPEATS * CHUNK / (wall * 1e-3) / 1e9
        print(f"  {name:40s} {wall:6.2f} ms wall, {cpu:6.2f} ms CPU, {rate:5.1f} G elements/s")


def chunk_sizes() -> None:
    shapes = [p.shape for p in _net("mlp").parameters()]
    first = [torch.randn(shape) for shape in shapes]
    second = [torch.randn(shape) for shape in shapes]
    join_wall, join_cpu = timed(lambda: _compat.foreach_add_(second, first))
    print(f"the window's end on the MLP's gradient shapes; the join alone: {join_wall:.2f} ms wall, {join_cpu:.2f} CPU")
    default = _dots.CPU_CHUNK
    try:
        for log2 in range(14, 21):
            _dots.CPU_CHUNK = 1 << log2
            wall, cpu = timed(lambda: _dots.gram_and_add_all_(first, second))
            mark = "  (the library's)" if 1 << log2 == default else ""
            print(
                f"  chunk 2^{log2}: {wall:6.2f} ms wall, {cpu:6.2f} ms CPU;"
                f" the products {wall - join_wall:5.2f} ms wall, {cpu - join_cpu:5.2f} ms CPU{mark}"
            )
    finally:
        _dots.CPU_CHUNK = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} thread(s)")
    kernels()
    chunk_sizes()


if __name__ == "__main__":
    main()

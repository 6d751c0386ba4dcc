"""What the one-process measurement costs without Lightning: plain accumulation, set-aside, copy snapshot.

    python benchmarks/measurement_cost.py        # ~30 seconds on 2 CPU cores

A window of 4 micro-batches of 32 through an 11.5M-parameter MLP, three ways, interleaved round by round:

- ``plain``: accumulate into ``p.grad`` (what Lightning does);
- ``set-aside``: what SimiGrad does -- the first half's gradients are taken off the parameters at the
  midpoint (no copy) and re-joined at the end in the pass that takes the three dot products;
- ``copy``: the alternative it replaced -- copy the gradient into a snapshot buffer at the midpoint and
  take the products of snapshot and final gradient at the end.

Prints the median window time of each and its ratio to ``plain``, last.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from lightning_simigrad.measurement._dots import gram
from lightning_simigrad.measurement.window_halves import WindowHalvesMeasurement


def main(rounds: int = 25) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 512),
    )  # fmt: skip
    params = list(net.parameters())
    xs = [torch.randn(32, 1024) for _ in range(4)]
    ys = [torch.randint(0, 512, (32,)) for _ in range(4)]
    halves = WindowHalvesMeasurement()
    snapshot = [torch.empty_like(p) for p in params]

    def window(mode: str) -> None:
        for p in params:
            p.grad = None
        for j in range(4):
            nn.functional.cross_entropy(net(xs[j]), ys[j]).div(4).backward()
            if mode == "set-aside" and j == 1:
                halves.set_aside(params)
            elif mode == "set-aside" and j == 3:
                halves.combine(params).tolist()  # the products, read to the host as collect() reads them
            elif mode == "copy" and j == 1:
                torch._foreach_copy_(snapshot, [p.grad for p in params])
            elif mode == "copy" and j == 3:
                torch.stack([gram(s, p.grad) for s, p in zip(snapshot, params)]).sum(0).tolist()

    times: dict[str, list[float]] = {"plain": [], "set-aside": [], "copy": []}
    for _ in range(rounds):
        for mode, samples in times.items():
            start = time.perf_counter()
            window(mode)
            samples.append(time.perf_counter() - start)
    base = statistics.median(times["plain"])
    for mode, samples in times.items():
        median = statistics.median(samples)
        print(f"{mode:>9}: {median * 1e3:6.1f} ms per window   ratio {median / base:.3f}")


if __name__ == "__main__":
    main()

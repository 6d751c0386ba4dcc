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

from lightning_simigrad import Window
from lightning_simigrad.measurement import window_halves
from lightning_simigrad.measurement._dots import gram


def main(rounds: int = 25) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 512),
    )  # fmt: skip
    params = list(net.parameters())
    xs = [torch.randn(32, 1024) for _ in range(4)]
    ys = [torch.randint(0, 512, (32,)) for _ in range(4)]
    halves = window_halves()
    four = Window(((32,), (32,), (32,), (32,)))
    snapshot = [torch.empty_like(p) for p in params]

    def window(mode: str) -> None:
        for p in params:
            p.grad = None
        for j in range(4):
            if mode == "set-aside":
                halves.start_micro_batch(four, j, params)
            nn.functional.cross_entropy(net(xs[j]), ys[j]).div(4).backward()
            if mode == "set-aside":
                halves.after_backward(four, j, (64, 64), params)
                if j == 3:
                    halves.collect(None)  # the products, read to the host
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

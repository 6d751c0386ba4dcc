"""What the one-process measurement costs without Lightning: plain accumulation against its designs.

    python benchmarks/measurement_cost.py                      # the MLP, ~1 minute on 2 CPU cores
    python benchmarks/measurement_cost.py --model bert_tiny --micro 8 --rounds 150
    python benchmarks/measurement_cost.py --only plain; python benchmarks/measurement_cost.py --only set-aside

A window of 4 micro-batches through one of ``benchmarks/overhead.py``'s models (default: an 11.5M-parameter MLP
1024-2048-2048-2048-512, micro-batches of 32), followed by an SGD step, in several ways, interleaved round by round
(the order rotating):

- ``plain``: accumulate into ``p.grad`` (what Lightning does);
- ``set-aside``: what SimiGrad does -- the first half's gradients are taken off the parameters at the midpoint
  (no copy), the second half keeps its first backward's tensor as plain keeps the first micro-batch's, and the
  halves are joined at the end in the pass that takes the three dot products;
- ``copy`` (``--copy``): the design set-aside replaced -- copy the gradient into a snapshot buffer at the midpoint
  and take the products of snapshot and final gradient at the end.

Prints the median wall and CPU time per window of each and their ratios to ``plain``. With ``--only MODE`` it runs
that mode alone and prints the process's peak resident memory beside one gradient's size: the peak is the whole
process's, so each mode needs a process of its own to be compared. Without Lightning's loop the
host's fixed cost is gone, so this isolates the measurement's arithmetic and memory traffic; the allocator's state
still moves plain's own window from run to run (docs/measurement.md, "Where the cost sits").
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import torch
from overhead import _data, _net
from torch import nn

from lightning_simigrad import Window
from lightning_simigrad.measurement import window_halves
from lightning_simigrad.measurement._dots import gram

WINDOW = 4


def _wide_mlp() -> nn.Module:
    """11.5M parameters: the model this benchmark's earlier figures were measured on."""
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 512),
    )  # fmt: skip


def _batches(name: str, micro: int) -> list[Callable[[nn.Module], torch.Tensor]]:
    """One loss function per micro-batch of the window."""
    if name == "mlp":
        xs = [torch.randn(micro, 1024) for _ in range(WINDOW)]
        ys = [torch.randint(0, 512, (micro,)) for _ in range(WINDOW)]
        return [lambda net, x=x, y=y: nn.functional.cross_entropy(net(x), y) for x, y in zip(xs, ys)]
    inputs, targets = _data(name, micro * WINDOW).tensors
    pairs = [(inputs[j * micro : (j + 1) * micro], targets[j * micro : (j + 1) * micro]) for j in range(WINDOW)]
    if name == "bert_tiny":
        return [lambda net, x=x, y=y: net(input_ids=x, labels=y).loss for x, y in pairs]
    return [lambda net, x=x, y=y: nn.functional.cross_entropy(net(x), y) for x, y in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "resnet18", "bert_tiny"), default="mlp")
    parser.add_argument("--micro", type=int, default=32, help="micro-batch size (the window is 4 of them)")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--copy", action="store_true", help="also the copy-based snapshot set-aside replaced")
    parser.add_argument(
        "--only",
        choices=("plain", "set-aside", "copy"),
        help="this mode alone, then the process's peak resident memory (one process per mode to compare them)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    net = _wide_mlp() if args.model == "mlp" else _net(args.model)
    params = list(net.parameters())
    losses = _batches(args.model, args.micro)
    optimizer = torch.optim.SGD(params, lr=0.0, momentum=0.9)  # the step's memory traffic, weights unchanged
    measurement = window_halves()
    window_plan = Window(tuple((args.micro,) for _ in range(WINDOW)))
    half = (2 * args.micro, 2 * args.micro)
    snapshot = [torch.empty_like(p) for p in params] if args.copy or args.only == "copy" else []

    def window(mode: str) -> None:
        measured = mode == "set-aside"
        optimizer.zero_grad()
        for j, loss in enumerate(losses):
            if measured:
                measurement.start_micro_batch(window_plan, j, params)
            loss(net).div(WINDOW).backward()
            if measured:
                measurement.after_backward(window_plan, j, half, params)
                if j == WINDOW - 1:
                    measurement.collect(None)  # the products, read to the host
            elif mode == "copy" and j == 1:
                torch._foreach_copy_(snapshot, [p.grad for p in params])
            elif mode == "copy" and j == WINDOW - 1:
                torch.stack([gram(s, p.grad) for s, p in zip(snapshot, params)]).sum(0).tolist()
        optimizer.step()

    modes = [args.only] if args.only else ["plain", "set-aside", *(["copy"] if args.copy else [])]
    wall: dict[str, list[float]] = {mode: [] for mode in modes}
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        first = round_ % len(modes)
        for mode in modes[first:] + modes[:first]:
            start, start_cpu = time.perf_counter(), time.process_time()
            window(mode)
            cpu[mode].append(time.process_time() - start_cpu)
            wall[mode].append(time.perf_counter() - start)
    print(
        f"{args.model}: {sum(p.numel() for p in params):,} parameters, micro-batch {args.micro}, window {WINDOW},"
        f" {args.rounds} rounds, {torch.get_num_threads()} threads"
    )
    if args.only:
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
        gradient_mib = sum(p.numel() * p.element_size() for p in params) / 2**20
        median, median_cpu = statistics.median(wall[args.only]), statistics.median(cpu[args.only])
        print(
            f"{args.only}: {median * 1e3:.1f} ms per window, {median_cpu * 1e3:.1f} ms of CPU;"
            f" peak resident memory {peak_mib:.0f} MiB (one gradient: {gradient_mib:.0f} MiB)"
        )
        return
    base, base_cpu = statistics.median(wall["plain"]), statistics.median(cpu["plain"])
    for mode in modes:
        median, median_cpu = statistics.median(wall[mode]), statistics.median(cpu[mode])
        print(
            f"{mode:>9}: {median * 1e3:7.1f} ms per window (ratio {median / base:.3f}),"
            f" {median_cpu * 1e3:7.1f} ms of CPU (ratio {median_cpu / base_cpu:.3f})"
        )


if __name__ == "__main__":
    main()

"""Step-time overhead of SimiGrad on one process, against plain Lightning accumulation.

    python benchmarks/overhead.py                   # the MLP, ~1 minute on 2 quiet CPU cores
    python benchmarks/overhead.py --model all       # also ResNet-18 and a tiny BERT (many parameter tensors)
    python benchmarks/overhead.py --model resnet18 --pairs 3 --steps 12 --micro 8
    python benchmarks/overhead.py --model tiny --pairs 8 --steps 60   # the callback's fixed cost per step

Models: ``mlp`` (512-2048-2048-2048-10: 9.5M parameters in 8 tensors), ``resnet18`` (torchvision's, 32x32
inputs: 11M parameters in 62 tensors) and ``bert_tiny`` (a 4-layer BERT masked LM from a config, hidden size 128:
1.4M parameters in 72 tensors). ``tiny`` (512-16-10: 8.4k parameters) has next to no arithmetic, so the
difference in milliseconds per step it prints is the callback's fixed cost on the host: its hooks, the data path's
planning, Lightning's dispatch to one more callback. The many-tensor models show what the measurement costs per
parameter tensor, which is what a GPU's kernel launches pay for (``benchmarks/launches.py`` counts the ops).

Every side trains the same model with the same micro-batch (``--micro``, 16) and window (4 micro-batches):
plain Lightning with ``accumulate_grad_batches=4``, and SimiGrad with ``adjust=False`` (it measures the halves
every step but keeps the batch fixed, so the sides do the same arithmetic otherwise), twice: as it is (*after*:
on CPU the large gradient tensors' products and the halves' addition stream through the cache chunk by chunk,
``measurement._dots.STREAM_AT_LEAST``) and as it was (*before*: every tensor through the fused multi-tensor ops,
three norms and the addition, four passes over memory). Either way the second half keeps its first backward's
tensor, as plain keeps the first micro-batch's. The sides run in turn, round by
round, in this one process, the order rotating; each round's ratio compares the median optimizer-step times
(wall and CPU) of the fits, and the medians over rounds are printed last, with the minor page faults per step
(``resource.getrusage``). Goal: CPU-time ratio <= 1.05, page faults within 10% of plain's.

Last, the floor: what the window's end computes (the three products and the join), timed alone on tensors shaped
as the model's gradient, against the join's addition alone, as a share of plain's step in CPU time. Plain
accumulation does that addition too, so the products are what no design that takes them with torch's kernels
avoids (for the MLP on a 2-vCPU AMD EPYC: 5.2% of plain's step, before the callback's fixed host cost).
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_simigrad import SimiGrad, _compat
from lightning_simigrad.measurement import _dots

STREAM_AT_LEAST = _dots.STREAM_AT_LEAST
WINDOW = 4


def _net(name: str) -> nn.Module:
    if name == "tiny":
        return nn.Sequential(nn.Linear(512, 16), nn.ReLU(), nn.Linear(16, 10))
    if name == "mlp":
        return nn.Sequential(
            nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
            nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10),
        )  # fmt: skip
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10)
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=2, intermediate_size=512, vocab_size=2000
    )
    return BertForMaskedLM(config)


def _data(name: str, n: int) -> TensorDataset:
    if name in ("mlp", "tiny"):
        return TensorDataset(torch.randn(n, 512), torch.randint(0, 10, (n,)))
    if name == "resnet18":
        return TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    tokens = torch.randint(0, 2000, (n, 32))
    return TensorDataset(tokens, tokens.clone())


class MLP(pl.LightningModule):
    """The benchmark's module (named for its first model); ``name`` picks the network."""

    def __init__(self, name: str = "mlp") -> None:
        super().__init__()
        self.name = name
        self.net = _net(name)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.name == "bert_tiny":
            return self.net(input_ids=x, labels=y).loss
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepTimer(pl.Callback):
    """Wall and process CPU time and minor page faults between consecutive optimizer steps, after a warm-up.

    CPU time is the steadier figure on a shared machine: another tenant's load stretches wall time but
    not the cycles this process spends.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.faults: list[int] = []
        self._last: tuple[float, float, int] | None = None

    def on_before_zero_grad(self, trainer, pl_module, optimizer):  # once per window, at its start
        now = (time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        if self._last is not None and trainer.global_step > self.warmup:
            self.times.append(now[0] - self._last[0])
            self.cpu_times.append(now[1] - self._last[1])
            self.faults.append(now[2] - self._last[2])
        self._last = now


# side -> stream the large tensors through the cache (else every one goes through the fused ops)
STREAMS = {"before": False, "after": True}


def timed_fit(side: str, steps: int, data: TensorDataset, micro: int, name: str = "mlp") -> tuple[float, float, float]:
    torch.manual_seed(0)
    timer = StepTimer(warmup=2)
    callbacks: list[pl.Callback] = [timer]
    if side != "plain":
        simigrad = SimiGrad(target_similarity=0.8, adjust=False)
        callbacks.insert(0, simigrad)
        # not streaming: no tensor is large enough to stream; every one goes through the fused ops
        _dots.STREAM_AT_LEAST = STREAM_AT_LEAST if STREAMS[side] else math.inf
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        accumulate_grad_batches=WINDOW,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MLP(name), DataLoader(data, batch_size=micro, shuffle=True))
    return statistics.median(timer.times), statistics.median(timer.cpu_times), statistics.median(timer.faults)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7, help="rounds of every side")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro", type=int, default=16, help="micro-batch size (the window is 4 of them)")
    parser.add_argument("--model", choices=("mlp", "tiny", "resnet18", "bert_tiny", "all"), default="mlp")
    args = parser.parse_args()
    for name in ("mlp", "resnet18", "bert_tiny") if args.model == "all" else (args.model,):
        measure(name, args.pairs, args.steps, args.micro)


def measure(name: str, rounds: int, steps: int, micro: int) -> None:
    n = micro * WINDOW * (steps + 2)
    data = _data(name, n)
    net = _net(name)
    params, tensors = sum(p.numel() for p in net.parameters()), len(list(net.parameters()))
    threads = torch.get_num_threads()
    print(
        f"model {name}: {params:,} parameters in {tensors} tensors; micro-batch {micro}, window {WINDOW},"
        f" {threads} threads"
    )
    designs = tuple(STREAMS)  # the measured sides, each beside plain
    sides = ("plain", *designs)
    wall: dict[str, list[float]] = {side: [] for side in designs}
    cpu: dict[str, list[float]] = {side: [] for side in designs}
    extra: dict[str, list[float]] = {side: [] for side in designs}  # wall ms per step more than plain
    faults: dict[str, list[float]] = {side: [] for side in sides}
    plain_cpu: list[float] = []
    for round_ in range(rounds):
        # rotate which side runs first, so drift in the machine's speed falls on all
        first = round_ % len(sides)
        order = sides[first:] + sides[:first]
        times = {side: timed_fit(side, steps, data, micro, name) for side in order}
        for side in designs:
            wall[side].append(times[side][0] / times["plain"][0])
            cpu[side].append(times[side][1] / times["plain"][1])
            extra[side].append((times[side][0] - times["plain"][0]) * 1e3)
        for side in sides:
            faults[side].append(times[side][2])
        plain_cpu.append(times["plain"][1])
        print(
            f"round {round_}: plain {times['plain'][0] * 1e3:7.1f} ms/step"
            + "".join(
                f"   {side} {times[side][0] * 1e3:7.1f} ms/step (wall {wall[side][-1]:.3f}, CPU {cpu[side][-1]:.3f})"
                for side in designs
            )
            + "   page faults/step "
            + " / ".join(f"{times[side][2]:.0f}" for side in sides)
        )
    for side in designs:
        print(
            f"{name}: SimiGrad(adjust=False) {side} / plain accumulation: median wall-time ratio"
            f" {statistics.median(wall[side]):.3f} ({statistics.median(extra[side]):+.2f} ms per step), median CPU-time"
            f" ratio {statistics.median(cpu[side]):.3f}"
        )
    print(
        f"{name}: minor page faults per step (median): "
        + ", ".join(f"{side} {statistics.median(faults[side]):.0f}" for side in sides)
    )
    arithmetic_floor(name, statistics.median(plain_cpu))


def _cpu_ms(fn, repeats: int) -> float:
    spent = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        spent.append(time.process_time() - start)
    return statistics.median(spent) * 1e3


def arithmetic_floor(name: str, plain_step_cpu: float, repeats: int = 30) -> None:
    """What the window's end computes, alone, on tensors shaped as the model's gradient: the three products and the
    join's addition, against the addition alone. Plain accumulation does that addition too (a fresh second half
    skips one of plain's additions and the join pays it back), so the products are what no design that takes them
    with torch's kernels avoids: the floor of the measurement's arithmetic, as a share of plain's step in CPU time."""
    _dots.STREAM_AT_LEAST = STREAM_AT_LEAST  # as the library runs (the last fit may have been a fused side)
    shapes = [p.shape for p in _net(name).parameters()]
    first = [torch.randn(shape) for shape in shapes]
    second = [torch.randn(shape) for shape in shapes]
    join = _cpu_ms(lambda: _compat.foreach_add_(second, first), repeats)
    products = _cpu_ms(lambda: _dots.gram_and_add_all_(first, second), repeats)
    floor = (products - join) / (plain_step_cpu * 1e3)
    print(
        f"{name}: at the window's end, the products and the join take {products:.2f} ms of CPU, the join's addition"
        f" alone {join:.2f} ms; the products' {products - join:.2f} ms are {floor:.1%} of plain's step"
        f" ({plain_step_cpu * 1e3:.1f} ms of CPU): the arithmetic's floor, a CPU-time ratio of {1 + floor:.3f}"
        " before the callback's fixed host cost (--model tiny)"
    )


if __name__ == "__main__":
    main()

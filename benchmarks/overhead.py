"""Step-time overhead of SimiGrad on one process, against plain Lightning accumulation.

    python benchmarks/overhead.py            # ~6 minutes on 2 CPU cores

Both sides train the same ~10M-parameter MLP with the same micro-batch (``--micro``, 32) and window (4
micro-batches, a global batch of 128): plain Lightning with ``accumulate_grad_batches=4``, and SimiGrad with
``adjust=False`` (it measures the halves every step -- a midpoint snapshot and three dot products -- but
keeps the batch fixed, so both sides do the same arithmetic otherwise). The two run alternately, pair by
pair, in this one process; each pair's ratio compares the median optimizer-step time of the two fits,
and the median over pairs is printed last. Goal: <= 1.05.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_simigrad import SimiGrad

WINDOW = 4


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
            nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 512),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepTimer(pl.Callback):
    """Wall and process CPU time between consecutive optimizer steps, after a warm-up.

    CPU time is the steadier figure on a shared machine: another tenant's load stretches wall time but
    not the cycles this process spends.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._last: tuple[float, float] | None = None

    def on_before_zero_grad(self, trainer, pl_module, optimizer):  # once per window, at its start
        now = (time.perf_counter(), time.process_time())
        if self._last is not None and trainer.global_step > self.warmup:
            self.times.append(now[0] - self._last[0])
            self.cpu_times.append(now[1] - self._last[1])
        self._last = now


def timed_fit(use_simigrad: bool, steps: int, data: TensorDataset, micro: int) -> tuple[float, float]:
    torch.manual_seed(0)
    timer = StepTimer(warmup=2)
    callbacks: list[pl.Callback] = [timer]
    if use_simigrad:
        callbacks.insert(0, SimiGrad(target_similarity=0.8, adjust=False))
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
    trainer.fit(MLP(), DataLoader(data, batch_size=micro, shuffle=True))
    return statistics.median(timer.times), statistics.median(timer.cpu_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro", type=int, default=32, help="micro-batch size (the window is 4 of them)")
    args = parser.parse_args()
    n = args.micro * WINDOW * (args.steps + 2)
    data = TensorDataset(torch.randn(n, 1024), torch.randint(0, 512, (n,)))
    params = sum(p.numel() for p in MLP().parameters())
    threads = torch.get_num_threads()
    print(f"model: {params / 1e6:.1f}M parameters; micro-batch {args.micro}, window {WINDOW}, {threads} threads")
    ratios, cpu_ratios = [], []
    for pair in range(args.pairs):
        # alternate which side runs first, so drift in the machine's speed falls on both
        order = (False, True) if pair % 2 == 0 else (True, False)
        times = {side: timed_fit(side, args.steps, data, args.micro) for side in order}
        ratios.append(times[True][0] / times[False][0])
        cpu_ratios.append(times[True][1] / times[False][1])
        plain, ours = times[False][0] * 1e3, times[True][0] * 1e3
        print(
            f"pair {pair}: plain {plain:7.1f} ms/step   simigrad {ours:7.1f} ms/step   ratio {ratios[-1]:.3f}"
            f"   (CPU time ratio {cpu_ratios[-1]:.3f})"
        )
    print(f"median CPU-time ratio: {statistics.median(cpu_ratios):.3f}")
    print(f"median step-time ratio SimiGrad(adjust=False) / plain accumulation: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()

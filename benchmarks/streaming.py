"""What a stream costs under SimiGrad: samples/s over a LitData stream, SimiGrad(adjust=False) against plain
Lightning over the same stream at the same batch, side by side, and the same over the samples as map-style data.

    python benchmarks/streaming.py                  # ~2 minutes on 2 CPU cores
    python benchmarks/streaming.py --rounds 8 --samples 32768

``litdata.optimize`` writes the samples (a 512-wide input and a target) into chunks once, in a process of its own.
Each round then runs four one-epoch fits of an MLP (512-1024-1024-1), in turn, the order rotating:

- *plain, stream*: Lightning with ``accumulate_grad_batches=2`` (a step of 64 samples) over ``StreamingDataset`` +
  ``StreamingDataLoader(batch_size=32, num_workers=2)``;
- *simigrad, stream*: ``SimiGrad(adjust=False, initial_batch_size=64)`` over the same stream: re-batched into windows
  of two loader batches (64 samples), the halves measured every step, the ranks' counts exchanged (nothing to
  exchange on one process), the loader's state taken before each window;
- *plain* and *simigrad* over the same samples as a map-style ``TensorDataset`` in memory (``shuffle=True``, no
  workers): what the measurement costs without a stream.

Each round prints the fits' samples/s on the stream (from the first training batch to the epoch's end: the loader's
workers start before it, alike for all) and the ratios plain/simigrad (SimiGrad's time over plain's) on the stream and
on map-style data, in wall time and in the training process's CPU time; the medians over rounds are printed last,
with the stream's own share (the first ratio over the second). Torch runs on one thread, the stream's two workers on
the other core. On a machine busy with other work the wall-time ratios scatter by tens of percent from round to
round; the CPU-time ones hold.

The BERT recipe's resident memory at 1x and 10x a corpus, read from token shards on disk, is measured by
``benchmarks/corpus_memory.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_simigrad import SimiGrad

WIDTH, BATCH = 512, 32

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# optimize's workers import the sample function by name: it runs where `benchmarks.streaming` is importable
_OPTIMIZE = """
import sys
from litdata import optimize
from benchmarks.streaming import sample
optimize(fn=sample, inputs=list(range(int(sys.argv[2]))), output_dir=sys.argv[1], chunk_bytes="1MB", num_workers=2)
"""


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``i``: a 512-wide input and a target that depends on it."""
    g = torch.Generator().manual_seed(i)
    x = torch.randn(WIDTH, generator=g)
    return x, x[:8].sum().reshape(1)


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        hidden = 1024
        self.net = nn.Sequential(
            nn.Linear(WIDTH, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Clock(pl.Callback):
    """Samples trained per second from the first training batch to the end of the epoch: the loader's workers
    start before it, the same for both sides, and are left out. Per second of wall time, and per second of the
    training process's CPU time (all its threads; the stream's workers are processes of their own, doing the same
    work for both sides), which holds steadier on a machine shared with other work."""

    def __init__(self) -> None:
        self.first: tuple[float, float] | None = None
        self.samples = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first is None:
            self.first = (time.perf_counter(), time.process_time())
        else:
            self.samples += len(batch[0])

    def rates(self) -> tuple[float, float]:
        assert self.first is not None
        wall, cpu = time.perf_counter() - self.first[0], time.process_time() - self.first[1]
        return self.samples / wall, self.samples / cpu


def loader_of(chunks: str, stream: bool) -> DataLoader:
    """The samples as a LitData stream, or the same samples as a map-style dataset in memory (shuffled, no workers:
    the baseline without a stream)."""
    from litdata import StreamingDataLoader, StreamingDataset

    if stream:
        return StreamingDataLoader(StreamingDataset(chunks), batch_size=BATCH, num_workers=2)
    x, y = zip(*(sample(i) for i in range(len(StreamingDataset(chunks)))))
    return DataLoader(TensorDataset(torch.stack(x), torch.stack(y)), batch_size=BATCH, shuffle=True)


def fit(chunks: str, simigrad: bool, stream: bool) -> tuple[float, float]:
    """One epoch; its samples per second of wall and of CPU time after the first batch."""
    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)  # the stream's two workers take the other core
    loader = loader_of(chunks, stream)
    clock = Clock()
    callbacks = [SimiGrad(target_similarity=0.5, adjust=False, initial_batch_size=2 * BATCH)] if simigrad else []
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[*callbacks, clock], accumulate_grad_batches=1 if simigrad else 2,
    )  # fmt: skip
    trainer.fit(MLP(), loader)
    return clock.rates()


SIDES = [(False, True), (True, True), (False, False), (True, False)]  # (simigrad, stream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=16384)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        chunks = os.path.join(tmp, "chunks")
        subprocess.run([sys.executable, "-c", _OPTIMIZE, chunks, str(args.samples)], cwd=ROOT, check=True,
                       capture_output=True, env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
        shares: dict[str, list[float]] = {"wall": [], "cpu": []}
        ratios: dict[str, list[float]] = {"stream wall": [], "map wall": [], "stream cpu": [], "map cpu": []}
        for r in range(args.rounds):
            order = SIDES[r % 4 :] + SIDES[: r % 4]  # the order rotates round by round
            rate = {side: fit(chunks, *side) for side in order}
            line = []
            for i, clock in enumerate(("wall", "cpu")):
                on_stream = rate[(False, True)][i] / rate[(True, True)][i]
                in_memory = rate[(False, False)][i] / rate[(True, False)][i]
                ratios[f"stream {clock}"].append(on_stream)
                ratios[f"map {clock}"].append(in_memory)
                shares[clock].append(on_stream / in_memory)
                share = shares[clock][-1]
                line.append(f"{clock}: stream {on_stream:.3f}, map-style {in_memory:.3f}, share {share:.3f}")
            print(f"round {r}: stream plain {rate[(False, True)][0]:6.0f}, simigrad {rate[(True, True)][0]:6.0f}"
                  f" samples/s; " + "; ".join(line), flush=True)  # fmt: skip
    median = statistics.median
    for clock in ("wall", "cpu"):
        print(f"median {clock}-time ratio simigrad/plain over {args.rounds} rounds: on the stream"
              f" {median(ratios[f'stream {clock}']):.3f}, on map-style data {median(ratios[f'map {clock}']):.3f};"
              f" the stream's own share {median(shares[clock]):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

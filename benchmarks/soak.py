"""Soak: thousands of optimizer steps on 2 processes, the batch changing every step; does anything grow?

    python benchmarks/soak.py                                      # 4000 steps: 2 to 10 minutes on 2 CPU cores
    python benchmarks/soak.py --steps 20000 --every 250            # a longer look
    python benchmarks/soak.py --steps 20000 --history-size all     # what an unbounded history costs
    python benchmarks/soak.py --steps 20000 --without-simigrad     # the baseline: plain Lightning, batch 192
    python benchmarks/soak.py --steps 20000 --fixed-batch          # SimiGrad measuring, batch held at 192

Two CPU processes (``ddp_spawn``, gloo) train on a stationary problem whose noise scale is known (as in
``tests/integration/test_equilibrium.py``: sample ``i``'s loss is ``w . v_i`` with ``v_i = G + noise``,
B_noise = 25), so at
target similarity 0.8 the batch hovers around B* = 200 and the paper rule moves it (x1.1 or x0.9) at every step,
in micro-batches of at most 32 per rank. A checkpoint is written every 500 steps
(as a long job would) and every epoch is 8192 samples, so epochs, data iterators and checkpoints turn over many
times. Every ``--every`` steps each rank records:

- its resident set size (``VmRSS`` of ``/proc/self/status``, after ``gc.collect()``);
- the callback's state: the rows in ``SimiGrad.history`` (bounded by ``history_size``, ``--history-size``
  here), the pickled size of ``state_dict()`` and the windows the sampler holds (planned ahead of training,
  dropped once trained). A checkpoint carries ``state_dict()`` plus every rank's random generator states, which
  ``on_save_checkpoint`` adds (``rng``: about 13 KB per rank, always the same size), so the saved entry is some
  13 KB per rank, not the few hundred bytes measured here.

``--without-simigrad`` trains the same model on the same data with plain Lightning DDP at a fixed batch of 192
(the soak's median), for the resident-memory slope that Lightning, torch and gloo have without SimiGrad;
``--fixed-batch`` runs SimiGrad with ``adjust=False`` at 192 (every step measured, no tensor ever changes shape).

Printed last, per rank: the least-squares slope of the resident size over the second half of the run (after
allocator warm-up), in KiB per 1000 steps, its first and last values, and the first and last values of each
state figure. Flat means a slope within a few KiB per 1000 steps and state figures that stop growing once
``history`` is full.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_simigrad import SimiGrad

EPOCH, DIM, NOISE_SCALE = 8192, 128, 25.0


def dataset() -> TensorDataset:
    """``v_i = G + sigma xi_i`` with ``|G|^2 = 1`` and ``tr(Sigma) = 25``: the gradient of ``w . v_i`` is ``v_i``."""
    g = torch.Generator().manual_seed(0)
    mean = torch.zeros(DIM)
    mean[0] = 1.0
    return TensorDataset(mean + (NOISE_SCALE / DIM) ** 0.5 * torch.randn(EPOCH, DIM, generator=g))


class LinearLoss(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(DIM))

    def training_step(self, batch, batch_idx):
        (v,) = batch
        return (v @ self.w).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def resident_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


class Probe(pl.Callback):
    """Samples resident memory and SimiGrad's state every ``every`` optimizer steps; rank files at the end."""

    def __init__(self, out: Path, every: int) -> None:
        self.out, self.every = out, every
        self.samples: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        simigrad = next((c for c in trainer.callbacks if isinstance(c, SimiGrad)), None)
        step = simigrad.steps if simigrad is not None else trainer.global_step
        if step % self.every or (self.samples and self.samples[-1]["step"] == step):
            return
        gc.collect()
        sample = dict(step=step, rss_kib=resident_kib(), history_rows=0, state_bytes=0, planned_windows=0)
        if simigrad is not None:
            sample.update(
                history_rows=len(simigrad.history),
                state_bytes=len(pickle.dumps(simigrad.state_dict())),
                planned_windows=len(simigrad.schedule.current.windows),
            )
        self.samples.append(sample)

    def on_train_end(self, trainer, pl_module):
        simigrad = next((c for c in trainer.callbacks if isinstance(c, SimiGrad)), None)
        sizes = [int(h["batch_size"]) for h in simigrad.history] if simigrad is not None else [192]
        changed = sum(a != b for a, b in zip(sizes, sizes[1:])) / max(len(sizes) - 1, 1)
        steps = simigrad.steps if simigrad is not None else trainer.global_step
        payload = dict(samples=self.samples, changed_fraction=changed, steps=steps, sizes=sizes)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(payload))


def slope_per_1000(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of ``(step, value)`` points, per 1000 steps."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4000, help="optimizer steps")
    parser.add_argument("--every", type=int, default=50, help="sample every this many steps")
    parser.add_argument(
        "--history-size",
        type=lambda v: None if v == "all" else int(v),
        default=1000,
        help="SimiGrad(history_size=...); 'all' keeps every step",
    )
    parser.add_argument("--without-simigrad", action="store_true", help="plain Lightning DDP at a fixed batch of 192")
    parser.add_argument("--fixed-batch", action="store_true", help="SimiGrad(adjust=False) at a batch of 192")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        pl.seed_everything(0)
        simigrad = SimiGrad(
            target_similarity=0.8,
            min_batch_size=16,
            max_batch_size=256,
            max_micro_batch_size=32,
            schedule_by_samples=False,  # max_steps counts optimizer steps here
            history_size=args.history_size,
            adjust=not args.fixed_batch,
            initial_batch_size=192 if args.fixed_batch else None,
        )
        checkpoints = ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=500, save_last=True)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp_spawn",
            max_steps=args.steps,
            max_epochs=-1,
            accumulate_grad_batches=6 if args.without_simigrad else 1,  # 6 x 16 x 2 ranks = 192
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=([] if args.without_simigrad else [simigrad]) + [checkpoints, Probe(out, args.every)],
        )
        start = time.perf_counter()
        trainer.fit(LinearLoss(), DataLoader(dataset(), batch_size=16, shuffle=True))
        elapsed = time.perf_counter() - start
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]

    print(f"\n{ranks[0]['steps']} optimizer steps on 2 processes in {elapsed:.0f} s")
    sizes = ranks[0]["sizes"]
    print(
        f"batch size changed at {100 * ranks[0]['changed_fraction']:.1f}% of the last {len(sizes)} steps"
        f" (range {min(sizes)}..{max(sizes)}, median {statistics.median(sizes):.0f})"
    )
    print("rank | RSS first -> last (MiB) | RSS slope, 2nd half (KiB/1000 steps) | history rows | state bytes | plan")
    for rank, result in enumerate(ranks):
        samples = result["samples"]
        second_half = [(s["step"], s["rss_kib"]) for s in samples if s["step"] >= samples[-1]["step"] / 2]
        first, last = samples[0], samples[-1]
        print(
            f"{rank:4} | {first['rss_kib'] / 1024:8.1f} -> {last['rss_kib'] / 1024:8.1f} |"
            f" {slope_per_1000(second_half):+10.1f}"
            f" | {first['history_rows']} -> {last['history_rows']}"
            f" | {first['state_bytes']} -> {last['state_bytes']}"
            f" | max {max(s['planned_windows'] for s in samples)}"
        )


if __name__ == "__main__":
    main()

"""ATen ops SimiGrad's measurement adds per optimizer step, for a model of few and of many parameter tensors.

    python benchmarks/launches.py            # about 2 minutes on 2 CPU cores

Every op is a kernel launch on a GPU (or a host-side call for views and metadata): a measurement whose op
count grows with the number of parameter tensors costs milliseconds per step on ResNet-50 (161 tensors)
or BERT-Large (about 400), whatever the speed of the device. This counts, with ``torch.profiler`` over
all threads (the gloo callbacks included), the top-level ATen ops (those not called from inside another
ATen op) of a run of optimizer steps, with and without the measurement, windows of 4 micro-batches:

- one process: a Lightning fit with ``SimiGrad(adjust=False)`` against plain ``accumulate_grad_batches=4``;
- DDP, W = 2 processes on gloo: a DDP model with ``RankGroupMeasurement`` (armed every window, collected
  after the backward) against plain DDP, ops counted on rank 0.

The two models have the same number of parameters (200,000), in 4 tensors or in 200; their forward
concatenates the parameters, so the model's own op count hardly depends on the number of tensors and
the difference between the rows is the measurement's. Printed: the extra ops per step for each model
and the slope per extra parameter tensor. Goal (issue 20): extra ops with 200 tensors <= 3 x those with
4 tensors + 30, on one process and on DDP.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _ports import reserve_port  # beside this file
from torch import nn
from torch.profiler import ProfilerActivity, profile

WINDOW = 4
MICRO = 8
PARAMETERS = 200_000
STEPS = 5  # profiled optimizer steps, after warm-up


class Many(nn.Module):
    """``PARAMETERS`` parameters in ``tensors`` equal tensors; a linear model over their concatenation."""

    def __init__(self, tensors: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        size = PARAMETERS // tensors
        self.pieces = nn.ParameterList([nn.Parameter(0.01 * torch.randn(size)) for _ in range(tensors)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.cat(list(self.pieces))


def _profiler() -> profile:
    from torch._C._profiler import _ExperimentalConfig  # a benchmark: torch's private config is fine here

    return profile(activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=True))


def top_level_ops(prof: profile) -> int:
    """ATen ops not called from inside another ATen op."""
    count = 0
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += parent is None
    return count


# ----------------------------------------------------------------------------------- one process


def one_process(tensors: int, measured: bool) -> float:
    """Top-level ATen ops per optimizer step of a Lightning fit."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_simigrad import SimiGrad

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Many(tensors)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Profiled(pl.Callback):
        """Profiles ``STEPS`` whole windows, from one window's zero_grad to the zero_grad ``STEPS`` later."""

        def __init__(self) -> None:
            self.prof: profile | None = None
            self.ops = 0

        def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == 2:
                self.prof = _profiler()
                self.prof.start()
            elif trainer.global_step == 2 + STEPS and self.prof is not None:
                self.prof.stop()
                self.ops = top_level_ops(self.prof)
                self.prof = None

    n = MICRO * WINDOW * (STEPS + 4)
    data = TensorDataset(torch.randn(n, PARAMETERS), torch.randn(n))
    profiled = Profiled()
    callbacks: list[Any] = [profiled]
    if measured:
        callbacks.insert(0, SimiGrad(target_similarity=0.8, adjust=False, initial_batch_size=MICRO * WINDOW))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=STEPS + 3,
        accumulate_grad_batches=1 if measured else WINDOW,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), DataLoader(data, batch_size=MICRO))
    return profiled.ops / STEPS


# ----------------------------------------------------------------------------------- DDP


def _ddp_worker(rank: int, world: int, port: int, tensors: int, out: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_simigrad.measurement.rank_groups import RankGroupMeasurement

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        counts = {}
        for measured in (False, True):
            model = DDP(Many(tensors))
            measurement = RankGroupMeasurement() if measured else None
            if measurement is not None:
                measurement.register(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
            gen = torch.Generator().manual_seed(rank)
            micro = [(torch.randn(MICRO, PARAMETERS, generator=gen), torch.randn(MICRO, generator=gen))] * WINDOW

            for _ in range(3):  # warm-up, past DDP's bucket rebuild
                _ddp_step(model, measurement, optimizer, micro, world)
            dist.barrier()
            prof = _profiler()
            prof.start()
            for _ in range(STEPS):
                _ddp_step(model, measurement, optimizer, micro, world)
            prof.stop()
            counts[measured] = top_level_ops(prof) / STEPS
            if measurement is not None:
                measurement.close()
            dist.barrier()
        if rank == 0:
            out.put(counts)
    finally:
        dist.destroy_process_group()


def _ddp_step(model: Any, measurement: Any, optimizer: Any, micro: list[Any], world: int) -> None:
    """One window of ``WINDOW`` micro-batches, ``no_sync`` but for the last; measured when ``measurement`` is set."""
    optimizer.zero_grad(set_to_none=True)
    for j, (x, y) in enumerate(micro):
        last = j == WINDOW - 1
        if last and measurement is not None:
            measurement.arm([MICRO * WINDOW] * world)
        with model.no_sync() if not last else _nothing():
            nn.functional.mse_loss(model(x), y).backward()
    if measurement is not None:
        measurement.collect()
    optimizer.step()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def ddp(tensors: int, world: int = 2) -> tuple[float, float]:
    """Top-level ATen ops per step on rank 0: (plain DDP, DDP + measurement)."""
    port = reserve_port()
    context = mp.get_context("spawn")
    out = context.Queue()
    mp.start_processes(_ddp_worker, args=(world, port, tensors, out), nprocs=world, start_method="spawn")
    counts = out.get(timeout=60)
    return counts[False], counts[True]


# ----------------------------------------------------------------------------------- the command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--few", type=int, default=4, help="parameter tensors of the small-count model")
    parser.add_argument("--many", type=int, default=200, help="parameter tensors of the large-count model")
    parser.add_argument("--skip-ddp", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    extra = {}
    for tensors in (args.few, args.many):
        plain, ours = one_process(tensors, False), one_process(tensors, True)
        extra[("one process", tensors)] = ours - plain
        rows.append(("one process", tensors, plain, ours))
    if not args.skip_ddp:
        for tensors in (args.few, args.many):
            plain, ours = ddp(tensors)
            extra[("DDP W=2 gloo", tensors)] = ours - plain
            rows.append(("DDP W=2 gloo", tensors, plain, ours))
    print(f"{'setting':<14} {'tensors':>7} {'plain':>9} {'measured':>9} {'extra':>8}   (top-level ATen ops per step)")
    for setting, tensors, plain, ours in rows:
        print(f"{setting:<14} {tensors:>7} {plain:>9.1f} {ours:>9.1f} {ours - plain:>8.1f}")
    ok = True
    for setting in dict.fromkeys(s for s, *_ in rows):
        few, many = extra[(setting, args.few)], extra[(setting, args.many)]
        slope = (many - few) / (args.many - args.few)
        goal = 3 * few + 30
        met = many <= goal
        ok &= met
        print(
            f"{setting}: {few:.0f} -> {many:.0f} extra ops, {slope:.2f} per tensor; "
            f"goal {args.many} tensors <= 3 x {args.few} tensors + 30 = {goal:.0f}: {'MET' if met else 'MISSED'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

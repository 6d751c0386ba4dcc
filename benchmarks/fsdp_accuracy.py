"""How closely SimiGrad's FSDP measurements read the halves in low precision: logged statistics against float64.

Run (about a minute on 2 CPU cores)::

    .venv/bin/python benchmarks/fsdp_accuracy.py

For each FSDP measurement -- FSDP1's two stages inside the reduce-scatter (W = 2), FSDP1's midpoint reduction
(W = 3) and FSDP2's halves in time (W = 2) -- and each mixed-precision policy -- float32 throughout; parameters
in bf16 with the reduction in float32; parameters and reduction in bf16 -- a Lightning fit of a float32 MLP
through ``SimiGrad`` on gloo CPU processes (FSDP1 through ``lightning_simigrad.testing.CPUFSDPStrategy``), every
step audited by ``lightning_simigrad.testing.StepAudit``: the products the measurement returned
(:math:`g_A \\cdot g_B`, :math:`|g_A|^2`, :math:`|g_B|^2`) against the float64 products of the same samples'
gradients at the same weights, and the logged similarity against the reference similarity.

The errors in the bf16 rows are mostly bf16's own (the forward and backward run in bf16), not the measurement's:
they are what a user reads against the exact value, which is the point of the table. Printed: per row, the
median and the largest relative error of the products (the dot product relative to :math:`|g_A| |g_B|`) and the
largest absolute error of the similarity, over the measured steps.
"""

from __future__ import annotations

import datetime
import math
import os
import statistics
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _ports import reserve_port  # beside this file
from torch import nn

SAMPLES = 256
POLICIES = ("fp32", "bf16 params, fp32 reduce", "bf16 params and reduce")
DESIGNS = (("FSDP1, two stages", 1, 2), ("FSDP1, midpoint reduction", 1, 3), ("FSDP2, halves in time", 2, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 16, generator=gen)
    return x, torch.sin(x[:, :4]) + 0.5 * torch.randn(SAMPLES, 4, generator=gen)


def _fit(version: int, world: int, policy: str) -> list[dict[str, float]]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_simigrad import SimiGrad
    from lightning_simigrad.testing import CPUFSDPStrategy, StepAudit

    x, y = _data()
    low = policy != "fp32"
    reduce = torch.bfloat16 if policy == "bf16 params and reduce" else torch.float32

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))

        def configure_model(self) -> None:
            if version == 2 and not getattr(self, "fully_sharded", False):
                mesh = self.device_mesh["data_parallel"]
                policy_ = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce) if low else None
                for layer in self.net[::2]:
                    fully_shard(layer, mesh=mesh, **({"mp_policy": policy_} if policy_ else {}))
                fully_shard(self, mesh=mesh, **({"mp_policy": policy_} if policy_ else {}))
                self.fully_sharded = True

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.net(inputs)  # each FSDP unit casts its inputs to its parameters' dtype

        def loss(self, indices: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(self(x[indices]).float(), y[indices])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.loss(batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def mean_loss(module: nn.Module, indices: list[int]) -> torch.Tensor:
        module.double()  # the reference: a copy in float64, at the same weights
        return nn.functional.mse_loss(module.net(x[indices].double()), y[indices].double())  # type: ignore[operator]

    class Products(pl.Callback):
        """What the measurement returned at every step (wraps its `collect`)."""

        def __init__(self) -> None:
            self.rows: list[tuple[float, float, float] | None] = []

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            measurement = simigrad.run.measurement  # type: ignore[union-attr]
            collect = measurement.collect

            def recording(loss_scale: Any) -> Any:
                stats = collect(loss_scale)
                self.rows.append((stats.dot, stats.sq_a, stats.sq_b) if stats is not None else None)
                return stats

            measurement.collect = recording

    if version == 2:
        strategy: Any = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        mixed = (
            MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce, cast_forward_inputs=True) if low else None
        )
        strategy = CPUFSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), mixed_precision=mixed)
    audit = StepAudit(indices=lambda batch: batch[0].tolist(), mean_loss=mean_loss)
    simigrad, products = SimiGrad(target_similarity=0.9, max_micro_batch_size=8, progress_bar=False), Products()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=1,
        callbacks=[simigrad, products, audit],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), DataLoader(TensorDataset(torch.arange(SAMPLES)), batch_size=8, shuffle=True))
    rows = []
    for row, measured, step in zip(simigrad.history, products.rows, audit.steps, strict=True):
        if measured is None or step.halves_products is None or not math.isfinite(row["similarity"]):
            continue
        (dot, sq_a, sq_b), (ref_dot, ref_a, ref_b) = measured, step.halves_products
        rows.append(
            {
                "dot": abs(dot - ref_dot) / math.sqrt(ref_a * ref_b),
                "sq": max(abs(sq_a - ref_a) / ref_a, abs(sq_b - ref_b) / ref_b),
                "similarity": abs(row["similarity"] - step.similarity),
                "measurement": type(simigrad.run.measurement).__name__,  # type: ignore[union-attr,dict-item]
            }
        )
    return rows


def _worker(rank: int, world: int, port: int, version: int, policy: str, out: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
        WORLD_SIZE=str(world), NODE_RANK="0",
    )  # fmt: skip
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=3))
    try:
        rows = _fit(version, world, policy)
        if rank == 0:
            out.put(rows)
    finally:
        dist.destroy_process_group()


def main() -> int:
    context = mp.get_context("spawn")
    print(
        f"fsdp_accuracy: a float32 MLP (16-64-64-4), {SAMPLES} samples, one epoch, micro-batches of 8;"
        f" torch {torch.__version__}",
        flush=True,
    )
    print(
        f"{'measurement':26s} | {'W':1s} | {'policy':24s} | steps | products median / max rel. error | similarity max"
    )
    for name, version, world in DESIGNS:
        for policy in POLICIES:
            out = context.SimpleQueue()
            args = (world, reserve_port(), version, policy, out)
            mp.start_processes(_worker, args=args, nprocs=world, start_method="spawn")
            rows = out.get()
            errors = [max(r["dot"], r["sq"]) for r in rows]
            print(
                f"{name:26s} | {world:1d} | {policy:24s} | {len(rows):5d} | {statistics.median(errors):.1e} /"
                f" {max(errors):.1e}{'':>17s} | {max(r['similarity'] for r in rows):.1e}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

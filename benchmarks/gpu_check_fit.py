"""One Lightning ``strategy="ddp"`` (or DeepSpeed) fit through ``SimiGrad``, for ``benchmarks/gpu_check.py``.

    python benchmarks/gpu_check_fit.py --accelerator gpu --devices 2 --precision 16-mixed --out result.json
    python benchmarks/gpu_check_fit.py --accelerator gpu --devices 2 --strategy deepspeed_stage_2 --precision 32-true \
        --out result.json

Lightning's ``ddp`` launcher starts the other ranks by running this script again, so it is a script of its
own (``gpu_check.py`` would start its whole check again in every rank). Lightning builds the DDP model under
a side stream of its own, so the measurement's hook runs on a different stream than ``collect()`` -- a case a
hand-built DDP never reaches. Every rank writes what it saw to ``--out`` with its rank appended; the
caller compares them: every measured step finite, the same decisions and parameters on every rank.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_simigrad import SimiGrad


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def strategy_of(name: str, accelerator: str) -> Any:
    if not name.startswith("deepspeed"):
        return name
    stage = int(name[-1])
    if accelerator == "cpu":  # Lightning refuses DeepSpeed on a CPU accelerator; the testing strategy serves it
        from lightning_simigrad.testing import CPUDeepSpeedStrategy

        return CPUDeepSpeedStrategy(stage=stage, process_group_backend="gloo")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return DeepSpeedStrategy(stage=stage)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="16-mixed")
    parser.add_argument(
        "--strategy",
        default="ddp",
        choices=["ddp", "deepspeed_stage_1", "deepspeed_stage_2"],
        help="DeepSpeed's ZeRO stages through Lightning's DeepSpeedStrategy (on CPU: testing.CPUDeepSpeedStrategy)",
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    n = 4096
    x = torch.randn(n, 32, generator=gen)
    y = torch.sin(x[:, :4]) + 0.3 * torch.randn(n, 4, generator=gen)
    simigrad = SimiGrad(target_similarity=0.8, initial_batch_size=64, max_micro_batch_size=16)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy_of(args.strategy, args.accelerator),
        precision=args.precision,
        max_steps=args.steps,
        callbacks=[simigrad],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Module()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    history = list(simigrad.history)
    flat = torch.cat([p.detach().float().reshape(-1).cpu() for p in module.parameters()])
    result = {
        "rank": trainer.global_rank,
        "world": trainer.world_size,
        "precision": args.precision,
        "steps": trainer.global_step,
        "similarities": [float(h.get("simigrad/similarity", h.get("similarity", math.nan))) for h in history],
        "batch_sizes": [int(h.get("simigrad/batch_size", h.get("batch_size", 0))) for h in history],
        "parameters": [float(flat.sum()), float(flat.abs().sum())],
    }
    with open(f"{args.out}.{trainer.global_rank}", "w") as f:
        json.dump(result, f)
    if dist.is_initialized():  # avoids the exit-time abort torch 2.14's process groups meet now and then
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

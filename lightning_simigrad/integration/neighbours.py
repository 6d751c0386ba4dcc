"""Where SimiGrad meets the rest of a Lightning setup: what it refuses, the tuners, the LR monitor.

- :func:`refuse_unsupported` and :func:`check_dataloader` stop a fit it cannot serve before the first
  step, with an error that names the setting and the fix.
- Lightning's tuners (``BatchSizeFinder``, ``LearningRateFinder``, and ``Tuner`` which adds them) run
  trial fits with every other callback removed. While one is attached SimiGrad stays out of the way,
  so the trials train at the DataLoader's own batch; it takes over when the tuner is done. A tuned
  batch size is the largest micro-batch that fits in memory: SimiGrad uses it as
  ``max_micro_batch_size``, while B0 stays the batch the learning rate was chosen for.
- SimiGrad runs its hooks before the other callbacks (tuners excepted), so they read the current
  micro-batch's window and learning rate whatever order the user listed them in.
- ``LearningRateMonitor`` reads ``param_groups`` between steps, where the scheduler's own value stays
  (schedulers read it back); :class:`AppliedLRMonitor` makes it report the learning rate the next
  optimizer step applies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import (
    BatchSizeFinder,
    Callback,
    GradientAccumulationScheduler,
    LearningRateFinder,
    LearningRateMonitor,
)
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from lightning.pytorch.utilities.parsing import lightning_getattr
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.utils.data import DataLoader, IterableDataset

__all__ = [
    "AppliedLRMonitor",
    "batch_size_before_tuning",
    "check_dataloader",
    "refuse_several_optimizers",
    "refuse_unsupported",
    "run_before_other_callbacks",
    "tuners",
]


def refuse_unsupported(trainer: pl.Trainer, pl_module: pl.LightningModule, max_micro_batch_size: int | None) -> None:
    if not pl_module.automatic_optimization:
        raise RuntimeError(
            "SimiGrad drives Lightning's automatic optimization (accumulation windows and the optimizer step);"
            " this LightningModule sets `automatic_optimization = False`. Use automatic optimization."
        )
    strategy: Strategy = trainer.strategy
    served = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy, FSDPStrategy)
    if not isinstance(strategy, served) or strategy.handles_gradient_accumulation:
        raise RuntimeError(
            f"SimiGrad supports a single device, DDP (`strategy='ddp'`, 'ddp_spawn', ...), FSDP1 (`strategy='fsdp'`)"
            f" and FSDP2 through `ModelParallelStrategy`; the Trainer uses `{type(strategy).__name__}`. DeepSpeed"
            " accumulates gradients itself, where the half-batch gradients cannot be measured. Use one of those."
        )
    if isinstance(strategy, FSDPStrategy):
        refuse_unserved_fsdp1(strategy.sharding_strategy.name, strategy.cpu_offload, "`FSDPStrategy`")
    if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        raise RuntimeError(
            "SimiGrad plans every micro-batch of a step, so `training_step` must take the batch Lightning gives it;"
            " this one takes `dataloader_iter` and fetches batches itself. Take `(batch, batch_idx)`."
        )
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, GradientAccumulationScheduler):
            raise RuntimeError(
                "SimiGrad sets the accumulation of every window itself; remove the `GradientAccumulationScheduler`"
                " callback (use `max_micro_batch_size` to bound the memory of a micro-batch)."
            )
        if isinstance(callback, BatchSizeFinder) and max_micro_batch_size is not None:
            raise RuntimeError(
                f"A `BatchSizeFinder` tunes the largest micro-batch that fits, which SimiGrad then uses as"
                f" `max_micro_batch_size`; this SimiGrad fixes `max_micro_batch_size={max_micro_batch_size}`."
                " Remove one of the two."
            )


FSDP1_SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP")  # every rank holds a disjoint shard of the reduced gradient


def refuse_unserved_fsdp1(sharding: str, cpu_offload: Any, where: str) -> None:
    """FSDP1 as its measurements serve it (:mod:`~lightning_simigrad.measurement.two_stage_reduce_scatter`,
    :mod:`~lightning_simigrad.measurement.midpoint_reduction`): sharded over every rank, the gradient on the device.
    """
    if sharding not in FSDP1_SHARDINGS:
        raise RuntimeError(
            f"SimiGrad under FSDP1 supports `sharding_strategy` {' or '.join(FSDP1_SHARDINGS)}; {where} uses"
            f" {sharding}, whose gradient is replicated across ranks. For hybrid sharding use"
            " `ModelParallelStrategy` with `fully_shard` on a (replicate, shard) mesh; for NO_SHARD use"
            " `strategy='ddp'`."
        )
    if getattr(cpu_offload, "offload_params", False):
        raise RuntimeError(
            f"SimiGrad under FSDP1 does not support CPU offload (untested: the measurement would read every gradient"
            f" shard on the CPU); {where} sets `cpu_offload={cpu_offload}`. Remove `cpu_offload`."
        )


def check_fsdp1_units(model: Any) -> None:
    """Every FSDP1 unit of the wrapped model served (units the module wrapped itself in ``configure_model`` too)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    world = torch.distributed.get_world_size()
    for unit in model.modules():
        if isinstance(unit, FullyShardedDataParallel):
            name = type(unit.module).__name__
            refuse_unserved_fsdp1(unit.sharding_strategy.name, unit.cpu_offload, f"the FSDP unit around `{name}`")
            ranks = torch.distributed.get_process_group_ranks(unit.process_group)
            if len(ranks) != world:
                raise RuntimeError(
                    f"SimiGrad under FSDP1 measures units sharded over all {world} ranks; the FSDP unit around"
                    f" `{name}` is sharded over ranks {ranks} (`process_group`). Shard every unit over all the ranks"
                    " (leave `process_group` out)."
                )


def refuse_several_optimizers(trainer: pl.Trainer) -> None:
    if len(trainer.optimizers) != 1:
        raise RuntimeError(
            f"SimiGrad scales one optimizer's learning rate; `configure_optimizers` returned"
            f" {len(trainer.optimizers)}. Return a single optimizer."
        )


def check_dataloader(loader: Any) -> None:
    if not isinstance(loader, DataLoader):
        raise RuntimeError(
            f"SimiGrad needs the training data as one `torch.utils.data.DataLoader`, got `{type(loader).__name__}`."
            " Return a single DataLoader from `train_dataloader`."
        )
    if isinstance(loader.dataset, IterableDataset):
        raise RuntimeError(
            f"SimiGrad plans every step's samples, which needs a sized map-style dataset; the training DataLoader"
            f" reads an IterableDataset (`{type(loader.dataset).__name__}`). Use a map-style Dataset."
        )
    try:
        len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        raise RuntimeError(
            f"SimiGrad needs the training dataset's length; `{type(loader.dataset).__name__}` has no `__len__`."
            " Implement `__len__`."
        ) from None
    if loader.batch_size is None:
        raise RuntimeError(
            "SimiGrad sizes micro-batches itself from the DataLoader's `batch_size`; this DataLoader has"
            " `batch_size=None` (a custom batch sampler or no batching). Pass `batch_size=` and no `batch_sampler`."
        )


def run_before_other_callbacks(trainer: pl.Trainer, callback: Callback) -> None:
    """Move ``callback`` ahead of every callback but the tuners (which must finish first).

    SimiGrad decides in ``on_train_batch_start`` which window a micro-batch belongs to, steps the schedules
    and sets the learning-rate factor; callbacks that read any of it (an LR monitor, a progress bar, the
    user's) then see the current micro-batch's values whatever order they were passed in. The list object
    is replaced, not changed in place, as Lightning may be iterating the old one.
    """
    others = [c for c in trainer.callbacks if c is not callback]  # type: ignore[attr-defined]
    first = [c for c in others if c in tuners(trainer)]
    trainer.callbacks = [*first, callback, *[c for c in others if c not in first]]  # type: ignore[attr-defined]


def tuners(trainer: pl.Trainer) -> list[Callback]:
    """The tuner callbacks attached to ``trainer`` (they run their trials in ``on_fit_start``)."""
    return [c for c in trainer.callbacks if isinstance(c, (BatchSizeFinder, LearningRateFinder))]  # type: ignore[attr-defined]


def batch_size_before_tuning(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int | None:
    """The batch size a ``BatchSizeFinder`` is about to tune (where the finder will read it), or None."""
    for callback in tuners(trainer):
        if isinstance(callback, BatchSizeFinder):
            try:
                value = lightning_getattr(pl_module, callback._batch_arg_name)
            except AttributeError:
                return None  # the finder itself reports the missing attribute
            return int(value) if isinstance(value, int) else None
    return None


class AppliedLRMonitor:
    """Makes every ``LearningRateMonitor`` of a fit report ``lr x factor()`` (the factor of the next step)."""

    def __init__(self, factor: Callable[[], float]) -> None:
        self._factor = factor
        self._monitors: list[LearningRateMonitor] = []

    def attach(self, trainer: pl.Trainer) -> None:
        for monitor in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(monitor, LearningRateMonitor) and "_extract_lr" not in monitor.__dict__:
                extract = monitor._extract_lr

                def extract_applied(
                    param_group: dict[str, Any], name: str, extract: Callable[..., dict[str, Any]] = extract
                ) -> dict[str, Any]:
                    return extract({**param_group, "lr": param_group["lr"] * self._factor()}, name)

                monitor._extract_lr = extract_applied  # type: ignore[method-assign]
                self._monitors.append(monitor)

    def detach(self) -> None:
        for monitor in self._monitors:
            monitor.__dict__.pop("_extract_lr", None)
        self._monitors = []

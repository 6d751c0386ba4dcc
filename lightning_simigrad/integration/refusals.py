"""What SimiGrad refuses, before the first step, with an error that names the setting, shows it and says the fix.

:func:`refuse_unsupported` runs in ``setup`` (the strategy, manual optimization, a ``training_step`` that fetches
its own batches, callbacks that set the accumulation), :func:`refuse_several_optimizers` when the fit starts,
:func:`check_dataloader` when the training data arrives. What a measurement needs of the wrapped model it checks
itself when it attaches (:mod:`lightning_simigrad.measurement`).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BatchSizeFinder, GradientAccumulationScheduler
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.utils.data import DataLoader, IterableDataset

from lightning_simigrad.core.units import Unit
from lightning_simigrad.measurement.sharding import refuse_unserved_fsdp1

__all__ = [
    "check_dataloader",
    "refuse_several_optimizers",
    "refuse_unserved_deepspeed",
    "refuse_unsupported",
    "refuse_weights_over_a_stream",
]


def refuse_unsupported(trainer: pl.Trainer, pl_module: pl.LightningModule, max_micro_batch_size: int | None) -> None:
    if not pl_module.automatic_optimization:
        raise RuntimeError(
            "SimiGrad drives Lightning's automatic optimization (accumulation windows and the optimizer step);"
            " this LightningModule sets `automatic_optimization = False`. Use automatic optimization."
        )
    strategy: Strategy = trainer.strategy
    served = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy, FSDPStrategy)
    if isinstance(strategy, DeepSpeedStrategy):
        refuse_unserved_deepspeed(strategy, trainer)
    elif not isinstance(strategy, served) or strategy.handles_gradient_accumulation:
        raise RuntimeError(
            f"SimiGrad supports a single device, DDP (`strategy='ddp'`, 'ddp_spawn', ...), FSDP1 (`strategy='fsdp'`),"
            f" FSDP2 through `ModelParallelStrategy` and DeepSpeed's ZeRO stages 1 and 2 (`DeepSpeedStrategy`); the"
            f" Trainer uses `{type(strategy).__name__}`. Use one of those."
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


def refuse_unserved_deepspeed(strategy: DeepSpeedStrategy, trainer: pl.Trainer) -> None:
    """DeepSpeed is served at ZeRO stages 1 and 2 in fp32 and bf16, without offload, with the engine's accumulation
    left to SimiGrad's windows (measurement/zero_partitions.py reads the partitions as that configuration lays them
    out)."""
    config = strategy.config or {}
    zero = config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage not in (1, 2):
        raise RuntimeError(
            f"SimiGrad measures DeepSpeed at ZeRO stages 1 and 2; this `DeepSpeedStrategy` runs stage {stage}."
            " At stage 0 the engine reduces the whole gradient at the boundary only and keeps no partition; at stage 3"
            " the parameters are partitioned too and no rank holds the window's first half to set aside. Use"
            " `DeepSpeedStrategy(stage=2)` (or 1)."
        )
    offloaded = [key for key in ("offload_optimizer", "offload_param") if zero.get(key)]
    if offloaded:
        raise RuntimeError(
            f"SimiGrad does not measure DeepSpeed with `{offloaded[0]}`: the gradient partitions then live in CPU"
            " buffers it does not read. Leave offloading out."
        )
    unserved = [f"`{key}` in its config" for key in ("fp16",) if (config.get(key) or {}).get("enabled")]
    if str(trainer.precision) not in ("32-true", "32", "bf16-mixed", "bf16-true"):
        unserved.append(f"`Trainer(precision={trainer.precision!r})`")
    accumulated_in = (config.get("data_types") or {}).get("grad_accum_dtype")
    if accumulated_in is not None:
        unserved.append(f"`data_types.grad_accum_dtype={accumulated_in!r}` in its config")
    if unserved:
        raise RuntimeError(
            f"SimiGrad measures DeepSpeed in fp32 and bf16 with gradients accumulated in the parameters' dtype; this"
            f" fit asks for {unserved[0]} (fp16 scales the loss, and a separate accumulation dtype keeps the gradient"
            " partitions in another layout). Use `precision='32-true'` or `'bf16-mixed'`, without `grad_accum_dtype`."
        )
    if trainer.accumulate_grad_batches != 1:
        raise RuntimeError(
            f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches!r})` with DeepSpeed: Lightning makes it"
            " DeepSpeed's `gradient_accumulation_steps`, by which the engine divides every micro-batch's gradient,"
            " while SimiGrad sets every window's accumulation and weighs its losses itself. Leave"
            " `accumulate_grad_batches` at 1 (bound a micro-batch's memory with `max_micro_batch_size`)."
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
    if loader.batch_size is None:
        raise RuntimeError(
            "SimiGrad sizes micro-batches itself from the DataLoader's `batch_size`; this DataLoader has"
            " `batch_size=None` (a custom batch sampler or no batching). Pass `batch_size=` and no `batch_sampler`."
        )
    if isinstance(loader.dataset, IterableDataset):
        return  # a stream: re-batched as it arrives (lightning_simigrad.integration.streams)
    try:
        len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        raise RuntimeError(
            f"SimiGrad needs a map-style training dataset's length; `{type(loader.dataset).__name__}` has no"
            " `__len__`. Implement `__len__`, or make it an `IterableDataset` (a stream)."
        ) from None


def refuse_weights_over_a_stream(unit: Unit) -> None:
    """Windows of weighted samples are planned over positions known ahead; a stream's windows are sized from what
    arrives."""
    if unit.weighted:
        raise RuntimeError(
            f"`{unit.setting}` plans windows to budgets of {unit.name} over a map-style dataset, whose samples and"
            " their weights are known ahead; this training DataLoader is a stream (an IterableDataset). Over a"
            f" stream, batches count the stream's samples: leave out `{unit.setting}` (and `max_micro_batch_tokens`)"
            " and keep `loss_items`, which weighs every token of a step exactly over a stream too."
        )

"""SimiGrad: adaptive batch size from the similarity of two half-batch gradients, as one Callback.

Every optimizer step the callback measures the cosine similarity of the mean gradients of two halves
of the global batch -- the two halves of the accumulation window on one process, two groups of ranks
under DDP -- and grows or shrinks the batch to hold it at ``target_similarity``, scaling the learning
rate to match. The user's LightningModule, optimizer, scheduler and DataLoader stay as they are: the
callback swaps the training DataLoader's batch sampler for an
:class:`~lightning_simigrad.sampler.AdaptiveBatchSampler` and makes Lightning's accumulation follow
its windows (:mod:`lightning_simigrad.accumulation`).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_simigrad.accumulation import VariableAccumulation
from lightning_simigrad.controller import BatchSizeController
from lightning_simigrad.lr_scaling import LR_SCALINGS, StepLRScaler, lr_factor
from lightning_simigrad.plan import Window
from lightning_simigrad.sampler import AdaptiveBatchSampler, WindowSchedule
from lightning_simigrad.statistics import HalfStats
from lightning_simigrad.window_measurement import WindowHalvesMeasurement

__all__ = ["SimiGrad", "METRICS"]

METRICS = (
    "simigrad/batch_size",
    "simigrad/similarity",
    "simigrad/lr_scale",
    "simigrad/micro_batch_size",
    "simigrad/accumulation",
    "simigrad/samples_seen",
    "simigrad/noise_scale",
)


class SimiGrad(Callback):
    r"""Adapt the global batch size every optimizer step to hold the half-batch gradient similarity.

    Args:
        target_similarity: cosine similarity of the two halves' gradients to hold, in (-1, 1). At
            equilibrium the batch is :math:`B^* = 2 B_{noise} \tau / (1 - \tau)`: 0.8 gives 8 noise scales.
        min_batch_size: smallest global batch (default: 2 on one process, the world size under DDP).
        max_batch_size: largest global batch (default: unbounded).
        max_micro_batch_size: most samples per device in one forward/backward (default: the
            DataLoader's ``batch_size``). Larger windows accumulate more micro-batches.
        adjust: ``False`` measures and logs but never changes the batch (the paper's ``enable_adjust``).
        lr_scaling: ``"sqrt"`` (the paper: lr x sqrt(B / B0)), ``"linear"`` or ``"none"``.
        lr_scaling_blend: the paper's blend f: the factor becomes ``(factor - 1) * f + 1``.
        controller: ``"paper"`` (x ``grow_factor`` below target, x ``shrink_factor`` above) or
            ``"noise_scale"`` (jump to :math:`B^*` from the smoothed measured noise scale).
        initial_batch_size: B0 (default: the DataLoader's batch size x world size x
            ``accumulate_grad_batches``). The learning rate the user configured belongs to B0.
        grow_factor, shrink_factor: the paper rule's factors.
        smoothing: EMA decay of the similarity the paper rule compares (0: none).
        noise_scale_decay: EMA decay of the noise-scale numerator and denominator.
        deadband: no change while the similarity is within this distance of the target.
        warmup_steps: measured steps before the first change.
        progress_bar: show the batch size in the progress bar.

    Raises:
        ValueError: at construction, for arguments out of range.
        RuntimeError: at setup, for a setup it cannot serve (manual optimization, a strategy other
            than single-device or DDP, ``GradientAccumulationScheduler``), and before the first step for
            a training DataLoader without a sized map-style dataset.

    The loss that ``training_step`` returns must be the mean over its micro-batch (the default of
    every torch loss): each sample of a step is then weighed by exactly ``1 / batch_size``.

    Example::

        from lightning_simigrad import SimiGrad

        trainer = L.Trainer(callbacks=[SimiGrad(target_similarity=0.8, min_batch_size=64,
                                                max_batch_size=65536, max_micro_batch_size=128)])
        trainer.fit(model, DataLoader(dataset, batch_size=64, shuffle=True, num_workers=2))
    """

    def __init__(
        self,
        target_similarity: float,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        max_micro_batch_size: int | None = None,
        adjust: bool = True,
        lr_scaling: str = "sqrt",
        lr_scaling_blend: float = 1.0,
        controller: str = "paper",
        initial_batch_size: int | None = None,
        grow_factor: float = 1.1,
        shrink_factor: float = 0.9,
        smoothing: float = 0.0,
        noise_scale_decay: float = 0.9,
        deadband: float = 0.0,
        warmup_steps: int = 0,
        progress_bar: bool = True,
    ) -> None:
        if lr_scaling not in LR_SCALINGS:
            raise ValueError(f"`lr_scaling` must be one of {LR_SCALINGS}, got {lr_scaling!r}.")
        if not (isinstance(lr_scaling_blend, (int, float)) and 0.0 <= lr_scaling_blend <= 1.0):
            raise ValueError(
                f"`lr_scaling_blend` must lie in [0, 1], got {lr_scaling_blend!r}. Use 1 for the full factor."
            )
        for name, value in (("max_micro_batch_size", max_micro_batch_size), ("initial_batch_size", initial_batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"`{name}` must be a positive int or None, got {value!r}.")
        self._controller_args: dict[str, Any] = dict(
            target_similarity=target_similarity,
            min_batch_size=min_batch_size,
            max_batch_size=max_batch_size,
            rule=controller,
            grow_factor=grow_factor,
            shrink_factor=shrink_factor,
            smoothing=smoothing,
            noise_scale_decay=noise_scale_decay,
            deadband=deadband,
            warmup_steps=warmup_steps,
        )
        # validates every controller argument now, before any Trainer exists
        BatchSizeController(initial_batch_size=initial_batch_size or min_batch_size or 1, **self._controller_args)
        self.target_similarity = target_similarity
        self.max_micro_batch_size = max_micro_batch_size
        self.adjust = adjust
        self.lr_scaling = lr_scaling
        self.lr_scaling_blend = float(lr_scaling_blend)
        self.initial_batch_size = initial_batch_size
        self.progress_bar = progress_bar

        self.controller: BatchSizeController | None = None
        self.schedule: WindowSchedule | None = None
        self.history: list[dict[str, float]] = []
        self.samples_seen = 0
        self.steps = 0
        self._accumulation = VariableAccumulation()
        self._lr = StepLRScaler()
        self._halves = WindowHalvesMeasurement()
        self._stats: HalfStats | None = None  # this window's, measured at its last backward on one process
        self._ranks: Any = None  # a RankGroupMeasurement under DDP
        self._loaded: dict[str, Any] = {}
        self._source: _DataLoaderSource | None = None
        self._window: Window | None = None
        self._micro = 0
        self._epoch_samples_done = 0
        self._world_size = 1
        self._rank = 0
        self._seed = 0  # the shuffling seed, agreed on by all ranks in `setup`

    # ------------------------------------------------------------------------------ readings
    @property
    def batch_size(self) -> int | None:
        """The global batch size the next window will be planned with (None before fit)."""
        return self.schedule.batch_size if self.schedule is not None else None

    @property
    def local_samples(self) -> int:
        """Samples this rank contributes in the current micro-batch (0: a zero-weight padding sample).

        A window smaller than the world size (a tiny epoch tail) leaves some ranks without a sample;
        they still run a step, on one sample whose loss is weighed by 0.
        """
        if self._window is None:
            return 0
        return self._window.sizes[self._micro][self._rank]

    # ------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _refuse_unsupported(trainer, pl_module)
        self._world_size, self._rank = trainer.world_size, trainer.global_rank
        # the shuffling seed comes from torch's RNG (so `seed_everything` governs it) and rank 0's wins
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        self._seed = int(trainer.strategy.broadcast(seed, src=0))
        self._source = trainer.fit_loop._data_source
        trainer.fit_loop._data_source = _AdaptiveDataLoaderSource(self._source, trainer, self)

    def adapt_dataloader(self, trainer: pl.Trainer, loader: Any) -> DataLoader:
        """The user's training DataLoader with its batch sampler replaced by an adaptive one."""
        _check_dataloader(loader)
        assert isinstance(loader, DataLoader) and loader.batch_size is not None
        if self.schedule is None:
            self._create_schedule(trainer, loader.batch_size)
        assert self.schedule is not None
        batch_sampler = AdaptiveBatchSampler(
            loader.sampler,  # type: ignore[arg-type]
            loader.batch_size,
            loader.drop_last,
            schedule=self.schedule,
            rank=self._rank,
        )
        return DataLoader(
            loader.dataset,
            batch_sampler=batch_sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator,
            prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
            persistent_workers=loader.persistent_workers,
            pin_memory_device=loader.pin_memory_device,
        )

    def _create_schedule(self, trainer: pl.Trainer, loader_batch_size: int) -> None:
        world = self._world_size
        min_micro_batches = 2 if world == 1 else 1
        b0 = self._loaded.get(
            "initial_batch_size",
            self.initial_batch_size or loader_batch_size * world * int(trainer.accumulate_grad_batches),
        )
        self._b0 = int(b0)
        args = dict(self._controller_args)
        # a measurement needs two halves: two samples on one process, one per rank under DDP
        args["min_batch_size"] = max(args["min_batch_size"] or 1, world * min_micro_batches)
        if args["max_batch_size"] is not None and args["max_batch_size"] < args["min_batch_size"]:
            raise ValueError(
                f"`max_batch_size` ({args['max_batch_size']}) is below the {args['min_batch_size']} samples a"
                f" measurement needs with {world} rank(s). Raise it."
            )
        self.controller = BatchSizeController(initial_batch_size=self._b0, **args)
        if "controller" in self._loaded:
            self.controller.load_state_dict(self._loaded["controller"])
        self.schedule = WindowSchedule(
            batch_size=self._loaded.get("batch_size", self.controller.batch_size),
            max_micro_batch_size=self.max_micro_batch_size or loader_batch_size,
            world_size=world,
            min_micro_batches=min_micro_batches,
            seed=self._loaded.get("seed", self._seed),
            epoch=lambda: _epoch_being_trained(trainer),
        )
        if "epoch" in self._loaded:
            self.schedule.resume_from = (self._loaded["epoch"], self._loaded["epoch_samples_done"])
        self.samples_seen = self._loaded.get("samples_seen", 0)
        self.steps = self._loaded.get("steps", 0)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise RuntimeError(
                f"SimiGrad scales one optimizer's learning rate; `configure_optimizers` returned"
                f" {len(trainer.optimizers)}. Return a single optimizer."
            )
        self._accumulation.attach(trainer)
        self._lr.attach(trainer.optimizers[0])
        if self._world_size > 1:
            from lightning_simigrad.ddp_measurement import RankGroupMeasurement

            self._ranks = RankGroupMeasurement()
            self._ranks.register(trainer.strategy.model)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.schedule is not None
        resume = self.schedule.resume_from
        self._epoch_samples_done = resume[1] if resume and resume[0] == _epoch_being_trained(trainer) else 0

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.schedule is not None
        self.schedule.resume_from = None

    # ------------------------------------------------------------------------------ per micro-batch
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self.schedule is not None
        window, micro = self.schedule.current.next_micro_batch()
        self._window, self._micro = window, micro
        if micro == 0:
            self._stats = None
        last = micro == window.num_micro_batches - 1
        local = self.local_samples
        self._accumulation.set_micro_batch(
            start=micro == 0,
            end=last,
            loss_divisor=window.total / (self._world_size * local) if local else math.inf,
        )
        # set for every micro-batch: if Lightning forces a step early (end of a limited epoch),
        # the step-time learning rate still matches the samples it averages
        self._lr.factor = lr_factor(window.samples_through[micro], self._b0, self.lr_scaling, self.lr_scaling_blend)
        if last and self._ranks is not None:
            per_rank = window.samples_per_rank()
            groups = {self._ranks.group_of(r) for r, n in enumerate(per_rank) if n}
            if len(groups) == 2:  # a tiny tail may leave one rank group without samples: nothing to compare
                self._ranks.arm(per_rank)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        window = self._window
        if self._ranks is not None or window is None or window.num_micro_batches < 2:
            return
        # one process: the halves are the window's two halves in time
        split, halves = window.half_split(), self._halves
        if self._micro == split - 1:
            halves.set_aside(list(pl_module.parameters()))
        elif self._micro == window.num_micro_batches - 1 and halves.holds_first_half:
            # before a GradScaler unscales and checks the gradient: both halves are still scaled alike
            n_a = window.samples_through[split - 1]
            self._stats = halves.combine(
                list(pl_module.parameters()), n_a, window.total - n_a, inv_scale=_inverse_loss_scale(trainer)
            )
        elif halves.holds_first_half and not trainer.fit_loop.epoch_loop._should_accumulate():
            halves.restore()  # Lightning steps before the window's end (a limited epoch): re-join, unmeasured

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        window = self._window
        assert window is not None and self.controller is not None and self.schedule is not None
        averaged = window.samples_through[self._micro]
        stats: HalfStats | None = None
        if averaged < window.total:
            # Lightning cut the window short (a limited epoch ends): re-weigh to a mean over what was fed
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, window.total / averaged)
            self._stats = None
        elif self._ranks is not None:
            stats = self._ranks.collect()
            inv_scale = _inverse_loss_scale(trainer)
            if stats is not None and inv_scale != 1.0:  # the comm hook saw the gradient still scaled
                stats = stats.scaled(inv_scale)
        else:
            stats, self._stats = self._stats, None
        self.samples_seen += averaged
        self._epoch_samples_done += averaged
        if stats is not None:
            next_size = self.controller.update(stats, adjust=self.adjust)
            if self.adjust:
                self.schedule.batch_size = next_size
        self._record(trainer, pl_module, averaged, stats, window)

    def _record(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, averaged: int, stats: HalfStats | None, window: Window
    ) -> None:
        assert self.controller is not None
        row = {
            "simigrad/batch_size": float(averaged),
            "simigrad/similarity": stats.similarity if stats is not None else math.nan,
            "simigrad/lr_scale": self._lr.factor,
            "simigrad/micro_batch_size": float(window.max_micro_batch_size),
            "simigrad/accumulation": float(self._micro + 1),
            "simigrad/samples_seen": float(self.samples_seen),
            "simigrad/noise_scale": self.controller.noise_scale,
        }
        self.history.append({"step": float(self.steps), **{k.split("/", 1)[1]: v for k, v in row.items()}})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(row, step=self.steps)
        if self.progress_bar and trainer.progress_bar_callback is not None:  # Lightning's logging is not free
            pl_module.log("batch_size", float(averaged), prog_bar=True, logger=False, on_step=True, on_epoch=False)
        self.steps += 1

    # ------------------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.schedule is None or self.controller is None:
            return dict(self._loaded)
        return {
            "batch_size": self.schedule.batch_size,
            "initial_batch_size": self._b0,
            "controller": self.controller.state_dict(),
            "samples_seen": self.samples_seen,
            "steps": self.steps,
            "accumulation": self._window.num_micro_batches if self._window is not None else 0,
            "seed": self.schedule.seed,
            # the epoch the counted samples belong to: the one whose windows are being trained
            "epoch": self.schedule.current.epoch,
            "epoch_samples_done": self._epoch_samples_done,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)

    # ------------------------------------------------------------------------------ teardown
    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._halves.restore()  # a fit interrupted inside a window leaves the gradient whole
        self._accumulation.detach()
        self._lr.detach()
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None
        if self._source is not None:
            trainer.fit_loop._data_source = self._source
            self._source = None


class _AdaptiveDataLoaderSource(_DataLoaderSource):
    """Lightning's training data source, returning the adapted DataLoader (so Lightning processes ours)."""

    def __init__(self, source: _DataLoaderSource, trainer: pl.Trainer, callback: SimiGrad) -> None:
        super().__init__(source.instance, source.name)
        self._trainer = trainer
        self._callback = callback

    def dataloader(self) -> Any:
        return self._callback.adapt_dataloader(self._trainer, super().dataloader())


def _refuse_unsupported(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    if not pl_module.automatic_optimization:
        raise RuntimeError(
            "SimiGrad drives Lightning's automatic optimization (accumulation windows and the optimizer step);"
            " this LightningModule sets `automatic_optimization = False`. Use automatic optimization."
        )
    strategy: Strategy = trainer.strategy
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or strategy.handles_gradient_accumulation:
        raise RuntimeError(
            f"SimiGrad supports a single device and DDP (`strategy='ddp'`, 'ddp_spawn', ...); the Trainer uses"
            f" `{type(strategy).__name__}`. DeepSpeed and FSDP shard or accumulate gradients themselves, where the"
            " half-batch gradients cannot be measured. Use `strategy='ddp'`."
        )
    # an epoch's number of micro-batches varies, so Lightning sees the training DataLoader as unsized
    if isinstance(trainer.val_check_interval, float) and trainer.val_check_interval != 1.0:
        raise RuntimeError(
            f"SimiGrad varies the number of micro-batches per epoch, so `val_check_interval` cannot be a fraction of"
            f" an epoch (got {trainer.val_check_interval}). Use 1.0 or an int (every k micro-batches)."
        )
    if isinstance(trainer.limit_train_batches, float) and trainer.limit_train_batches not in (0.0, 1.0):
        raise RuntimeError(
            f"SimiGrad varies the number of micro-batches per epoch, so `limit_train_batches` cannot be a fraction"
            f" (got {trainer.limit_train_batches}). Use an int number of micro-batches."
        )
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, GradientAccumulationScheduler):
            raise RuntimeError(
                "SimiGrad sets the accumulation of every window itself; remove the `GradientAccumulationScheduler`"
                " callback (use `max_micro_batch_size` to bound the memory of a micro-batch)."
            )


def _check_dataloader(loader: Any) -> None:
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


def _epoch_being_trained(trainer: pl.Trainer) -> int:
    # what Lightning gives samplers' `set_epoch`; unlike `current_epoch` it is already the next epoch
    # when a run resumes from a checkpoint written at an epoch's end
    return int(trainer.fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]


def _inverse_loss_scale(trainer: pl.Trainer) -> float:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return 1.0 / float(scaler.get_scale())

"""SimiGrad: adaptive batch size from the similarity of two half-batch gradients, as one Callback.

Every optimizer step the callback measures the cosine similarity of the mean gradients of two halves
of the global batch -- the two halves of the accumulation window on one process, two groups of ranks
under DDP -- and grows or shrinks the batch to hold it at ``target_similarity``, scaling the learning
rate to match. The user's LightningModule, optimizer, scheduler and DataLoader stay as they are: the
callback swaps the training DataLoader's batch sampler for an
:class:`~lightning_simigrad.sampler.AdaptiveBatchSampler`, makes Lightning's accumulation follow its
windows (:mod:`lightning_simigrad.accumulation`) and counts Lightning's step-based settings in samples
(:mod:`lightning_simigrad.progress`).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, SequentialSampler
from typing_extensions import override

from lightning_simigrad import spawn_results
from lightning_simigrad._ddp_scalars import scale_tensor
from lightning_simigrad.accumulation import VariableAccumulation
from lightning_simigrad.checkpoint import FORMAT_VERSION, validate_state
from lightning_simigrad.compatibility import (
    AppliedLRMonitor,
    batch_size_before_tuning,
    check_dataloader,
    refuse_unsupported,
    run_before_other_callbacks,
    tuners,
)
from lightning_simigrad.controller import BatchSizeController
from lightning_simigrad.lr_scaling import LR_SCALINGS, StepLRScaler, lr_factor
from lightning_simigrad.plan import Window
from lightning_simigrad.progress import SampleProgress
from lightning_simigrad.progress_bar import EpochProgress, postfix_fields
from lightning_simigrad.rng import all_ranks_rng_states, rng_state, set_rng_state
from lightning_simigrad.sample_counts import FitLength, epoch_limit, validation_interval
from lightning_simigrad.sampler import (
    AdaptiveBatchSampler,
    ResumePoint,
    WindowSchedule,
    shuffles,
    with_batch_sampler,
)
from lightning_simigrad.statistics import HalfStats
from lightning_simigrad.window_measurement import WindowHalvesMeasurement

__all__ = ["SimiGrad", "METRICS"]

METRICS = (
    "simigrad/batch_size",
    "simigrad/similarity",
    "simigrad/lr_scale",
    "simigrad/lr",
    "simigrad/micro_batch_size",
    "simigrad/accumulation",
    "simigrad/samples_seen",
    "simigrad/noise_scale",
)

spawn_results.install()  # here, so that ddp_spawn's children (which import this module) install it too


class SimiGrad(Callback):
    r"""Adapt the global batch size every optimizer step to hold the half-batch gradient similarity.

    Args:
        target_similarity: cosine similarity of the two halves' gradients to hold, in (-1, 1). At
            equilibrium the batch is :math:`B^* = 2 B_{noise} \tau / (1 - \tau)`: 0.8 gives 8 noise scales.
        min_batch_size: smallest global batch (default: 2 on one process, the world size under DDP).
        max_batch_size: largest global batch (default: unbounded).
        max_micro_batch_size: most samples per device in one forward/backward (default: the
            DataLoader's ``batch_size``, or what a ``BatchSizeFinder`` found). Larger windows accumulate
            more micro-batches.
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
        schedule_by_samples: count step-interval LR schedulers, ``max_steps`` and
            ``trainer.estimated_stepping_batches`` in steps of B0 samples, so that a schedule written for
            B0 follows the data trained (see :mod:`lightning_simigrad.progress`). ``False``: Lightning's
            own counting, per optimizer step.
        max_samples: end the fit after this many samples (the last step takes exactly what is left).
        progress_bar: show the batch size, similarity and noise scale in the progress bar's postfix.
        history_size: how many of the latest steps :attr:`history` keeps (None: every step of the fit,
            0: none). Loggers receive every step whatever it is.

    Raises:
        ValueError: at construction, for arguments out of range; when a checkpoint is restored, for a
            SimiGrad state that is malformed or of another format version, and for a checkpoint written in
            the middle of an epoch of a training set of another size.
        RuntimeError: at setup, for a setup it cannot serve (manual optimization, a strategy other
            than single-device or DDP, ``GradientAccumulationScheduler``, a ``training_step`` that takes
            ``dataloader_iter``), and before the first step for a training DataLoader without a sized
            map-style dataset.

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
        schedule_by_samples: bool = True,
        max_samples: int | None = None,
        progress_bar: bool = True,
        history_size: int | None = 10_000,
    ) -> None:
        if lr_scaling not in LR_SCALINGS:
            raise ValueError(f"`lr_scaling` must be one of {LR_SCALINGS}, got {lr_scaling!r}.")
        if not (isinstance(lr_scaling_blend, (int, float)) and 0.0 <= lr_scaling_blend <= 1.0):
            raise ValueError(
                f"`lr_scaling_blend` must lie in [0, 1], got {lr_scaling_blend!r}. Use 1 for the full factor."
            )
        for name, value in (
            ("max_micro_batch_size", max_micro_batch_size),
            ("initial_batch_size", initial_batch_size),
            ("max_samples", max_samples),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"`{name}` must be a positive int or None, got {value!r}.")
        if history_size is not None and (
            isinstance(history_size, bool) or not isinstance(history_size, int) or history_size < 0
        ):
            raise ValueError(
                f"`history_size` must be a non-negative int or None, got {history_size!r}. Use None to keep every"
                " step, 0 to keep none."
            )
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
        self.schedule_by_samples = bool(schedule_by_samples)
        self.max_samples = max_samples
        self.progress_bar = progress_bar
        self.history_size = history_size

        self.controller: BatchSizeController | None = None
        self.schedule: WindowSchedule | None = None
        # one row per step, the latest `history_size` of them: a long fit's memory stays flat
        self.history: list[dict[str, float]] = []
        self.samples_seen = 0
        self.steps = 0
        self._accumulation = VariableAccumulation()
        self._lr = StepLRScaler()
        self._lr_monitors = AppliedLRMonitor(self._upcoming_lr_factor)
        self._epoch_progress = EpochProgress(self._postfix)
        self._halves = WindowHalvesMeasurement()
        self._progress = SampleProgress(self._fit_length, self._counters, self._validation_interval)
        self._stats: HalfStats | None = None  # this window's, measured at its last backward on one process
        self._ranks: Any = None  # a RankGroupMeasurement under DDP
        self._loaded: dict[str, Any] = {}  # the state of the checkpoint the fit resumes from
        self._resumed_without_state = False  # the checkpoint has no SimiGrad state: resume at B0
        # this rank's random generator states from the checkpoint, restored where the uninterrupted run draws next:
        # at the first training batch (mid-epoch) or before the new epoch's data iterator is made (its seed draw)
        self._rng: dict[str, Any] | None = None
        self._rng_at_first_batch = False
        self._window_rng: dict[str, Any] | None = None  # the states as the current window started
        self._source: _DataLoaderSource | None = None
        self._trainer: pl.Trainer | None = None
        self._active = False  # False while a tuner runs its trials: SimiGrad then stays out of the way
        self._batch_size_before_tuning: int | None = None
        self._data: tuple[int, int, bool] | None = None  # (epoch order length, DataLoader batch_size, drop_last)
        self._b0 = 0
        self._window: Window | None = None
        self._micro = 0
        self._fed = [0, 0]  # samples whose backward ran in this window: first half, second half (all ranks)
        self._epoch_samples_done = 0  # the sampler's position: samples of the committed windows, skipped ones too
        self._last_similarity = math.nan
        self._batch_range = (2**63, 0)  # smallest and largest step of this process's fits
        self._b0_steps = 0  # the samples trained so far, in steps of B0 (what the fixed batch takes)
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

        A window smaller than the world size (a tiny epoch) leaves some ranks without a sample; they
        still run a step, on one sample whose loss is weighed by 0.
        """
        if self._window is None:
            return 0
        return self._window.sizes[self._micro][self._rank]

    # ------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        refuse_unsupported(trainer, pl_module, self.max_micro_batch_size)
        self._trainer = trainer
        run_before_other_callbacks(trainer, self)
        self._world_size, self._rank = trainer.world_size, trainer.global_rank
        # the shuffling seed comes from torch's RNG (so `seed_everything` governs it) and rank 0's wins
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        self._seed = int(trainer.strategy.broadcast(seed, src=0))
        self._source = trainer.fit_loop._data_source
        trainer.fit_loop._data_source = _AdaptiveDataLoaderSource(self._source, trainer, self)
        # a tuner's trials (in its `on_fit_start`, which Lightning runs before ours) train plain batches
        self._active = not tuners(trainer)
        if not self._active:
            self._batch_size_before_tuning = batch_size_before_tuning(trainer, pl_module)
        self._progress.schedule_by_samples = self.schedule_by_samples
        self._progress.active = self._active
        self._progress.attach(trainer)

    def adapt_dataloader(self, trainer: pl.Trainer, loader: Any) -> Any:
        """The user's training DataLoader with its batch sampler replaced by an adaptive one."""
        check_dataloader(loader)
        assert isinstance(loader, DataLoader) and loader.batch_size is not None
        # `overfit_batches` trains the same first samples every epoch, in order
        overfit = getattr(trainer, "overfit_batches", 0) > 0
        order: Any = SequentialSampler(loader.dataset) if overfit else loader.sampler  # type: ignore[arg-type]
        self._data = (len(order), loader.batch_size, loader.drop_last)
        if self.schedule is None:
            self._b0 = self._initial_batch_size(trainer, loader.batch_size)
        if not self._active:
            return loader
        if self.schedule is None:
            self._create_schedule(trainer, loader.batch_size, order)
        assert self.schedule is not None
        limit = self._epoch_samples()
        self.schedule.epoch_limit = limit if limit < len(order) else None
        batch_sampler = AdaptiveBatchSampler(
            order,
            loader.batch_size,
            loader.drop_last,
            schedule=self.schedule,
            rank=self._rank,
        )
        return with_batch_sampler(loader, batch_sampler)

    def _initial_batch_size(self, trainer: pl.Trainer, loader_batch_size: int) -> int:
        """B0: checkpointed, given, or the DataLoader's batch (before any tuning) x world x accumulation."""
        if "initial_batch_size" in self._loaded:
            return int(self._loaded["initial_batch_size"])
        per_device = self._batch_size_before_tuning or loader_batch_size
        return self.initial_batch_size or per_device * self._world_size * int(trainer.accumulate_grad_batches)

    def _create_schedule(self, trainer: pl.Trainer, loader_batch_size: int, order: Any) -> None:
        world = self._world_size
        min_micro_batches = 2 if world == 1 else 1
        self._b0 = self._initial_batch_size(trainer, loader_batch_size)
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
            batch_size=self._within_bounds(self._loaded.get("batch_size", self.controller.batch_size)),
            max_micro_batch_size=self.max_micro_batch_size or loader_batch_size,
            world_size=world,
            min_micro_batches=min_micro_batches,
            seed=self._loaded.get("seed", self._seed),
            epoch=lambda: _epoch_being_trained(trainer),
            samples_left=self._samples_left,
        )
        self.samples_seen = self._loaded.get("samples_seen", 0)
        self.steps = self._loaded.get("steps", 0)
        self._progress.load_state_dict(self._loaded.get("progress", {}))
        if self._loaded:
            self._resume(trainer, order)
        elif self._resumed_without_state:
            self._warn_resumed_without_state(trainer)
            # counted as the fixed-batch run that wrote the checkpoint counted: its steps were B0 samples, and
            # the step schedules it restored continue from where they are
            self.steps = trainer.global_step
            self.samples_seen = trainer.global_step * self._b0
            self._progress.continue_restored_schedules()
        self._validation_interval()  # refuses an interval validation would never reach, before training

    def _within_bounds(self, size: int) -> int:
        """A checkpointed batch size within this fit's bounds, which may differ from the fit that wrote it (a
        `max_batch_size` lowered after an out-of-memory error, another world size)."""
        assert self.controller is not None
        size = max(size, self.controller.min_batch_size)
        high = self.controller.max_batch_size
        return size if high is None else min(size, high)

    def _warn_resumed_without_state(self, trainer: pl.Trainer) -> None:
        message = (
            f"The checkpoint {trainer.ckpt_path} has no SimiGrad state (it was written by a fit without the SimiGrad"
            " callback): SimiGrad starts again at the initial batch size B0 with a new controller, counting the"
            " checkpoint's steps as steps of B0 samples."
        )
        batches = trainer.fit_loop.epoch_loop.batch_progress
        if trainer.fit_loop.restarting and batches.current.ready > 0 and not batches.is_last_batch:
            epoch = _epoch_being_trained(trainer)
            message += (
                f" It was written {batches.current.ready} batches into epoch {epoch}, and nothing in it says which"
                f" samples they held: epoch {epoch} restarts from its first sample, so those batches' samples are"
                " trained again (plain Lightning, too, restarts a DataLoader that cannot resume from its first"
                " sample). Resume from a checkpoint written at an epoch's end to avoid it."
            )
        rank_zero_warn(message)

    def _resume(self, trainer: pl.Trainer, order: Any) -> None:
        """Pick the epoch up where the checkpoint left it, or refuse a resume that cannot be exact.

        ``order`` is the sampler whose order the epoch follows."""
        assert self.schedule is not None and self._data is not None
        loaded = self._loaded
        epoch, done = loaded["epoch"], loaded["epoch_samples_done"]
        # a checkpoint written at the epoch's last batch ends it: Lightning then trains the next epoch
        last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        same_epoch = epoch == _epoch_being_trained(trainer) and not last_batch
        mid_epoch = same_epoch and done > 0
        if mid_epoch and loaded["epoch_length"] != self._data[0]:
            raise ValueError(
                f"The checkpoint {trainer.ckpt_path} was written {done} samples into epoch {epoch} of a training set"
                f" of {loaded['epoch_length']} samples; this fit's training set has {self._data[0]}, so the rest of"
                " that epoch cannot be identified. Resume with the same training data, or from a checkpoint written"
                " at the end of an epoch."
            )
        if same_epoch and (done > 0 or loaded["planned"]) and self._world_size == 1 and shuffles(order) is None:
            # (under DDP the sampler refuses such an order)
            rank_zero_warn(
                f"The checkpoint {trainer.ckpt_path} was written in the middle of epoch {epoch}, and the training"
                f" DataLoader's `{type(order).__name__}` has an order SimiGrad cannot regenerate (only a RandomSampler"
                " without replacement and a SequentialSampler have one): the rest of the epoch is taken from a new"
                f" draw of that order, past its first {done} samples, not from the order the interrupted run was"
                " following. Unless the sampler yields the same order every time, the resumed run trains other"
                f" samples in epoch {epoch} than the uninterrupted run. Resume from a checkpoint written at an epoch's"
                " end for an exact resume."
            )
        planned = tuple(self._within_bounds(size) for size in loaded["planned"])
        self.schedule.resume_from = ResumePoint(epoch, done, planned)
        if self.schedule.batch_size != loaded["batch_size"] or planned != tuple(loaded["planned"]):
            assert self.controller is not None
            low, high = self.controller.min_batch_size, self.controller.max_batch_size
            need = self.schedule.world_size * self.schedule.min_micro_batches
            rank_zero_warn(
                f"The checkpoint {trainer.ckpt_path} asks for batch sizes outside this fit's bounds, {low} to"
                f" {'any size' if high is None else high} (`min_batch_size` and `max_batch_size`, and at least the"
                f" {need} samples a measurement needs on {self._world_size} rank(s)): its batch size"
                f" {loaded['batch_size']} and the windows it had planned, {list(loaded['planned'])}, are brought"
                f" within them ({self.schedule.batch_size}, {list(planned)}). The resumed run therefore differs from"
                " the uninterrupted one from its first step."
            )
        self._epoch_samples_done = done if mid_epoch else 0
        states = loaded.get("rng")
        if states is not None and len(states) == self._world_size:  # on other ranks, their streams start anew
            self._rng, self._rng_at_first_batch = states[self._rank], same_epoch
            self._restore_rng_before_new_epoch()  # Lightning makes the data iterator right after this
            self._progress.before_next_epoch = self._restore_rng_before_new_epoch
        if loaded["world_size"] != self._world_size:
            rank_zero_info(
                f"SimiGrad: resuming a checkpoint written on {loaded['world_size']} rank(s) on {self._world_size}:"
                f" batch size {self.schedule.batch_size}, B0 {self._b0}, {self.samples_seen} samples seen; the rest"
                f" of epoch {epoch} is shared among the {self._world_size} rank(s)."
            )

    def _restore_rng_before_new_epoch(self) -> None:
        if self._rng is not None and not self._rng_at_first_batch:
            set_rng_state(self._rng)

    # ------------------------------------------------------------------------------ progress in samples
    def _epoch_samples(self) -> int:
        """Samples an epoch feeds: the epoch's order, or what ``limit_train_batches`` leaves of it."""
        assert self._data is not None
        samples, batch_size, _ = self._data
        limit = epoch_limit(samples, batch_size, self._world_size, self._progress.setting("limit_train_batches"))
        return samples if limit is None else limit

    def _samples_left(self) -> float:
        """Samples the fit may still train: ``max_samples``, and ``max_steps`` counted in B0-steps."""
        trainer = self._trainer
        assert trainer is not None
        budget = float(self.max_samples) if self.max_samples is not None else math.inf
        if self.schedule_by_samples and trainer.max_steps != -1:
            budget = min(budget, float(trainer.max_steps * self._b0))
        return budget - self.samples_seen

    def _fit_length(self) -> FitLength | None:
        trainer = self._trainer
        if trainer is None or self._data is None or not self._b0:
            return None
        return FitLength(
            initial_batch_size=self._b0,
            epoch_samples=self._epoch_samples(),
            drop_last=self._data[2],
            max_epochs=int(trainer.max_epochs) if trainer.max_epochs is not None else -1,
            budget=self._samples_left() + self.samples_seen,
        )

    def _counters(self) -> tuple[int, int, int]:
        assert self._trainer is not None
        return _epoch_being_trained(self._trainer), self._epoch_samples_done, self.samples_seen

    def _validation_interval(self) -> tuple[int, bool] | None:
        trainer = self._trainer
        assert trainer is not None and self._data is not None
        if trainer.limit_val_batches == 0:
            return None
        return validation_interval(
            self._epoch_samples(),
            self._data[1],
            self._world_size,
            self._progress.setting("val_check_interval"),
            trainer.check_val_every_n_epoch,
        )

    # ------------------------------------------------------------------------------ the fit
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise RuntimeError(
                f"SimiGrad scales one optimizer's learning rate; `configure_optimizers` returned"
                f" {len(trainer.optimizers)}. Return a single optimizer."
            )
        if not self._active:  # the tuners are done: train from here with adaptive windows
            self._active = self._progress.active = True
            trainer.fit_loop._combined_loader = None  # reload the (tuned) DataLoader through our source
        self._accumulation.attach(trainer)
        self._lr.attach(trainer.optimizers[0])
        self._lr_monitors.attach(trainer)
        if self.progress_bar:
            self._epoch_progress.attach(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # here rather than in `on_fit_start`, after every other callback's: a communication hook one of them
        # registers there is then found and refused with a clear error, not met by torch's own
        if self._world_size > 1 and self._ranks is None:
            from lightning_simigrad.ddp_measurement import RankGroupMeasurement

            self._ranks = RankGroupMeasurement()
            self._ranks.register(trainer.strategy.model)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.schedule is None or not self._active:
            return
        resume = self.schedule.resume_from
        resumed = resume is not None and resume.epoch == _epoch_being_trained(trainer)
        self._epoch_samples_done = resume.samples_done if resume is not None and resumed else 0
        # the epoch's micro-batches if every window were planned at the batch size asked for now
        samples = int(min(self._epoch_samples() - self._epoch_samples_done, max(self._samples_left(), 1)))
        window = self.schedule.plan(max(1, min(self.schedule.batch_size, samples)))
        self._epoch_progress.start_epoch(trainer, math.ceil(samples * window.num_micro_batches / window.total))

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.schedule is not None:
            self.schedule.resume_from = None

    # ------------------------------------------------------------------------------ per micro-batch
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        assert self.schedule is not None
        if self._rng is not None:
            if self._rng_at_first_batch:
                set_rng_state(self._rng)
            self._rng = None
        window, micro = self.schedule.current.next_micro_batch()
        self._window, self._micro = window, micro
        if micro == 0:
            self._window_rng = rng_state()  # a checkpoint written inside this window resumes from its start
            self._stats, self._fed = None, [0, 0]
            self._halves.discard()  # a window an epoch's early end abandoned is dropped, as Lightning drops it
            self._progress.start_window(window.total)
        left, exact = self.schedule.current.micro_batches_left()
        self._epoch_progress.update(
            trainer, left, epoch_ends_here=exact and left == 0 and self.schedule.current.ends_epoch
        )
        if self._ranks is None and micro == window.half_split() and micro > 0:
            # one process: the halves are the window's two halves in time. The first half's gradient
            # is set aside before the second half's first backward (after any skipped micro-batch too)
            self._halves.set_aside(list(pl_module.parameters()))
        local = self.local_samples
        self._accumulation.set_micro_batch(
            start=micro == 0,
            end=micro == window.num_micro_batches - 1,
            loss_divisor=window.total / (self._world_size * local) if local else math.inf,
            window_length=window.num_micro_batches,
        )
        # Lightning runs the window's last micro-batch inside `optimizer.step`, after its pre-hook
        self._lr.factor = self._lr_factor(window.total)
        if micro == window.num_micro_batches - 1 and self._ranks is not None:
            per_rank = window.samples_per_rank()
            groups = {self._ranks.group_of(r) for r, n in enumerate(per_rank) if n}
            if len(groups) == 2:  # a tiny epoch may leave one rank group without samples: nothing to compare
                self._ranks.arm(per_rank)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        window = self._window
        if window is None or not self._active:
            return
        self._fed[self._micro >= window.half_split()] += sum(window.sizes[self._micro])
        halves = self._halves
        if self._ranks is not None or not halves.holds_first_half or not self._accumulation.window_end:
            return
        # the window's last backward, before a GradScaler unscales and checks the gradient: both halves
        # are still scaled alike. Each half is the mean of the samples it fed.
        n_a, n_b = self._fed
        self._stats = halves.combine(
            list(pl_module.parameters()), n_a, n_b, inv_scale=_inverse_loss_scale(trainer), total=window.total
        )

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self._active:
            return
        window = self._window
        assert window is not None and self.controller is not None and self.schedule is not None
        self._halves.restore()  # the last micro-batch was skipped: re-join the halves, unmeasured
        fed = sum(self._fed)
        stats: HalfStats | None = None
        if self._ranks is not None:
            # the comm hook saw the gradient still scaled: collect() reads the scaler's scale tensor with
            # the statistics, in its one host transfer
            stats = self._ranks.collect(loss_scale=getattr(trainer.precision_plugin, "scaler", None))
        else:
            stats, self._stats = self._stats, None
        if 0 < fed < window.total:
            # micro-batches were skipped (`training_step` returned None): a mean over what was fed
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, window.total / fed)
            self._lr.rescale(self._lr_factor(fed))
        self.schedule.current.commit()
        before = self._epoch_samples_done, self.samples_seen
        self.samples_seen += fed
        # the epoch's position is where the sampler stands: the whole window it drew, skipped micro-batches too
        self._epoch_samples_done += window.total
        self._progress.record_step(before[0], self._epoch_samples_done, before[1], self.samples_seen)
        if stats is not None:
            next_size = self.controller.update(stats, adjust=self.adjust)
            if self.adjust:
                self.schedule.batch_size = next_size
        self._record(trainer, pl_module, fed, stats, window)
        if self._samples_left() <= 0:
            self._progress.end_fit()  # `max_samples` (or `max_steps` in B0-steps) reached exactly

    def _lr_factor(self, samples: int) -> float:
        return lr_factor(samples, self._b0, self.lr_scaling, self.lr_scaling_blend)

    def _upcoming_lr_factor(self) -> float:
        """The factor of the step the micro-batch being started belongs to (for the LR monitor, which runs
        after SimiGrad's ``on_train_batch_start``); at an epoch's start, that of the batch size asked for."""
        schedule = self.schedule
        if schedule is None or not self._active:
            return 1.0
        return self._lr.factor if self._window is not None else self._lr_factor(schedule.batch_size)

    def _postfix(self) -> dict[str, str] | None:
        """SimiGrad's progress-bar entries: this step's batch, the last similarity measured, the noise scale."""
        if self._window is None or self.controller is None or self._data is None:
            return None
        widest = max(self.controller.max_batch_size or 0, self._epoch_samples())
        return postfix_fields(self._window.total, len(str(widest)), self._last_similarity, self.controller.noise_scale)

    def _record(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, averaged: int, stats: HalfStats | None, window: Window
    ) -> None:
        assert self.controller is not None
        row = {
            "simigrad/batch_size": float(averaged),
            "simigrad/similarity": stats.similarity if stats is not None else math.nan,
            "simigrad/lr_scale": self._lr.factor,
            "simigrad/lr": self._lr.applied_lr(),
            "simigrad/micro_batch_size": float(window.max_micro_batch_size),
            "simigrad/accumulation": float(self._micro + 1),
            "simigrad/samples_seen": float(self.samples_seen),
            "simigrad/noise_scale": self.controller.noise_scale,
        }
        if self.history_size != 0:
            self.history.append({"step": float(self.steps), **{k.split("/", 1)[1]: v for k, v in row.items()}})
            if self.history_size is not None and len(self.history) > self.history_size:
                del self.history[: len(self.history) - self.history_size]
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(row, step=self.steps)
        self.steps += 1
        if math.isfinite(row["simigrad/similarity"]):
            self._last_similarity = row["simigrad/similarity"]
        if averaged:
            low, high = self._batch_range
            self._batch_range = (min(low, averaged), max(high, averaged))
        self._b0_steps = self._progress.steps_done()

    def summary(self) -> dict[str, int]:
        """The fit so far in numbers: optimizer steps, samples, batch-size range, and the steps B0 would take."""
        low, high = self._batch_range
        return {
            "optimizer_steps": self.steps,
            "samples": self.samples_seen,
            "initial_batch_size": self._b0,
            "min_batch_size": low if high else 0,
            "max_batch_size": high,
            "steps_at_initial_batch_size": self._b0_steps,
        }

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active or not trainer.is_global_zero or not self.steps:
            return
        numbers = self.summary()
        ratio = numbers["steps_at_initial_batch_size"] / max(1, numbers["optimizer_steps"])
        rank_zero_info(
            f"SimiGrad: {numbers['optimizer_steps']} optimizer steps over {numbers['samples']} samples, batch size"
            f" {numbers['min_batch_size']}..{numbers['max_batch_size']} (B0 = {numbers['initial_batch_size']});"
            f" a fixed batch of {numbers['initial_batch_size']} takes {numbers['steps_at_initial_batch_size']}"
            f" steps ({ratio:.1f}x as many)"
        )
        for logger in trainer.loggers:
            run: Any = getattr(logger, "experiment", None)
            if hasattr(run, "summary") and hasattr(run.summary, "update"):  # a W&B run: its summary table
                run.summary.update({f"simigrad/{k}": v for k, v in numbers.items()})
            else:
                logger.log_metrics({f"simigrad/summary/{k}": float(v) for k, v in numbers.items()}, step=self.steps)

    # ------------------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.schedule is None or self.controller is None or self._data is None:
            return dict(self._loaded)
        return {
            "format_version": FORMAT_VERSION,
            "batch_size": self.schedule.batch_size,
            "initial_batch_size": self._b0,
            "controller": self.controller.state_dict(),
            "samples_seen": self.samples_seen,
            "steps": self.steps,
            "seed": self.schedule.seed,
            # the epoch the counted samples belong to: the one whose windows are being trained
            "epoch": self.schedule.current.epoch,
            "epoch_samples_done": self._epoch_samples_done,
            # windows the sampler planned ahead of training, not yet averaged by a step: a resumed run plans them
            # again, so it trains what the uninterrupted run trained (they were planned with earlier decisions)
            "planned": self.schedule.current.pending,
            "epoch_length": self._data[0],
            "world_size": self._world_size,
            "progress": self._progress.state_dict(),
        }

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state:
            # the generators where the resumed run picks up: now, or as the window a resume trains again started, or,
            # resumed and before the first batch, the checkpoint's states that still wait to be restored there
            inside = self.schedule is not None and self.schedule.current.inside_window
            if self._rng is not None and self._rng_at_first_batch:
                local = self._rng
            elif inside and self._window_rng is not None:
                local = self._window_rng
            else:
                local = rng_state()
            # every rank's: a collective, on all ranks as Lightning's own saving is (it ends in a barrier)
            state["rng"] = all_ranks_rng_states(local)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning calls `load_state_dict` only when the checkpoint holds a state for this callback
        self._loaded, self._resumed_without_state = {}, self.state_key not in checkpoint.get("callbacks", {})
        self._forget_pending_rng()  # an earlier resume's, if its fit ended before a batch
        self._window_rng = None
        self.schedule = self.controller = None  # built again from the checkpoint's state when the data loads

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer = self._trainer
        where = str(trainer.ckpt_path) if trainer is not None and trainer.ckpt_path else "the checkpoint"
        self._loaded = dict(validate_state(state_dict, where))
        self.schedule = self.controller = None  # built again from the checkpoint's state when the data loads

    # ------------------------------------------------------------------------------ ddp_spawn
    def spawn_state(self) -> dict[str, Any]:
        """What the launching process's copy of this callback needs after a ``ddp_spawn`` fit."""
        return {"state": self.state_dict(), "history": self.history}

    def load_spawn_state(self, state: dict[str, Any]) -> None:
        self.history = list(state["history"])
        self._loaded = dict(state["state"])
        self.samples_seen = self._loaded.get("samples_seen", 0)
        self.steps = self._loaded.get("steps", 0)
        if "controller" in self._loaded:
            self.controller = BatchSizeController(
                initial_batch_size=self._loaded["initial_batch_size"], **self._controller_args
            )
            self.controller.load_state_dict(self._loaded["controller"])
            self._b0 = self._loaded["initial_batch_size"]
            self.schedule = WindowSchedule(batch_size=self._loaded["batch_size"], max_micro_batch_size=1)

    # ------------------------------------------------------------------------------ teardown
    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._detach(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips `teardown` after an error: leave the gradient whole and the Trainer as it was
        self._detach(trainer)

    def _forget_pending_rng(self) -> None:
        """Drop the checkpoint's generator states that wait to be restored, and the hook that restores them."""
        self._rng, self._rng_at_first_batch = None, False
        self._progress.before_next_epoch = None

    def _detach(self, trainer: pl.Trainer) -> None:
        self._forget_pending_rng()  # a resumed fit that ended before its first batch never restored them
        self._halves.restore()  # a fit stopped inside a window leaves the gradient whole
        self._accumulation.detach()
        self._lr.detach()
        self._lr_monitors.detach()
        self._epoch_progress.detach()
        self._progress.detach()
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None
        if self._source is not None:
            trainer.fit_loop._data_source = self._source
            self._source = None
        self._active = False


class _AdaptiveDataLoaderSource(_DataLoaderSource):
    """Lightning's training data source, returning the adapted DataLoader (so Lightning processes ours)."""

    def __init__(self, source: _DataLoaderSource, trainer: pl.Trainer, callback: SimiGrad) -> None:
        super().__init__(source.instance, source.name)
        self._trainer = trainer
        self._callback = callback

    def dataloader(self) -> Any:
        return self._callback.adapt_dataloader(self._trainer, super().dataloader())


def _epoch_being_trained(trainer: pl.Trainer) -> int:
    # what Lightning gives samplers' `set_epoch`; unlike `current_epoch` it is already the next epoch
    # when a run resumes from a checkpoint written at an epoch's end
    return int(trainer.fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]


def _inverse_loss_scale(trainer: pl.Trainer) -> float | torch.Tensor:
    """``1 / loss scale`` of a GradScaler, left on the device: the measurement reads it with its products."""
    scale = scale_tensor(getattr(trainer.precision_plugin, "scaler", None))
    if scale is None:
        return 1.0
    return scale.double().reciprocal() if isinstance(scale, torch.Tensor) else 1.0 / scale

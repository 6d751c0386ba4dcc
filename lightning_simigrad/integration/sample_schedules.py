r"""Lightning's step-based settings, served in samples (see :mod:`lightning_simigrad.core.sample_counts`).

:class:`SampleSchedules` replaces four private methods on Lightning's loop *instances* for the length of
a fit, and restores them after:

- ``_update_learning_rates``: step-interval LR schedulers (not plateau ones) are stepped until they have
  taken as many steps as B0-steps of samples were trained (``frequency`` counts B0-steps within each epoch,
  as Lightning counts batches within each epoch); before a window
  trains they are brought to the B0-step in its middle, so a step of :math:`k B_0` samples applies the
  schedule's value halfway through the :math:`k` fixed-batch steps it stands for;
- ``_should_check_val_fx``: validation after the samples of ``val_check_interval``, only ever between
  optimizer steps (a time-based interval is Lightning's rule, asked after each step; a stop the fit loop
  carries out and an epoch without optimizer steps keep Lightning's own rule; a stop that
  ``min_epochs``/``min_steps`` hold back keeps the cadence);
- ``setup_data``: Lightning loads the training data without ``limit_train_batches`` and without a
  fractional ``val_check_interval`` (both of which it would refuse or apply in micro-batches for a loader
  without a length); the sampler serves them in samples;
- the epoch loop's ``reset``: a run resumed from a checkpoint written at an epoch's last batch starts the
  next epoch. Lightning recognises that case by counting the epoch's batches, which a loader without a
  length does not have: it would find the restored ``is_last_batch`` and skip the whole next epoch.

For the length of a fit it also makes that Trainer's ``estimated_stepping_batches`` the fit's length in
B0-steps (refused, with the fix, for a stream that nothing bounds): the Trainer object is given a subclass of
its own class, made once per class, whose property asks the attached :class:`SampleSchedules`; its class is
given back after the fit. Lightning's classes and every other Trainer are left as they are.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer import call

from lightning_simigrad.run import Run

__all__ = ["SampleSchedules"]


class SampleSchedules:
    """Makes Lightning's scheduler stepping, validation cadence and step estimate follow samples.

    Until :attr:`run` is set (the training data has arrived, and no tuner is running its trials) Lightning's
    own behaviour is kept.

    Args:
        schedule_by_samples: step-interval schedulers and ``estimated_stepping_batches`` in B0-steps
            (False: Lightning's own, per optimizer step).
    """

    def __init__(self, schedule_by_samples: bool = True) -> None:
        self.schedule_by_samples = schedule_by_samples
        self.run: Run | None = None  # the fit's run: its lengths, counters and validation interval
        self.active = True  # False while a tuner runs its trials: Lightning loads the data as it would
        self._continue_restored = False  # align the counts to the first progress, stepping nothing
        self._last_step_span: tuple[int, int, int, int] | None = None  # (epoch done before/after, total before/after)
        self._trainer: pl.Trainer | None = None
        self._originals: dict[str, Any] = {}
        self._hidden: dict[str, Any] = {}  # the user's settings, while Lightning loads the data without them
        self._min_bounds: tuple[Any, Any] | None = None  # the user's (min_epochs, min_steps), lifted by `end_fit`

    # ------------------------------------------------------------------------------ wiring
    def attach(self, trainer: pl.Trainer) -> None:
        fit_loop = trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop
        self._trainer = trainer
        self._originals = {
            "_update_learning_rates": epoch_loop._update_learning_rates,
            "_should_check_val_fx": epoch_loop._should_check_val_fx,
            "setup_data": fit_loop.setup_data,
            "reset": epoch_loop.reset,
        }
        epoch_loop._update_learning_rates = self._update_learning_rates  # type: ignore[method-assign]
        epoch_loop.reset = self._reset_epoch_loop  # type: ignore[method-assign]
        epoch_loop._should_check_val_fx = self._should_check_val_fx  # type: ignore[method-assign]
        fit_loop.setup_data = self._setup_data  # type: ignore[method-assign]
        if self.schedule_by_samples:
            trainer.__class__ = _counting_in_samples(type(trainer))
            trainer.__dict__[_PROVIDER] = self.stepping_batches

    def detach(self) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        if self._min_bounds is not None:
            trainer.fit_loop.min_epochs, trainer.fit_loop.epoch_loop.min_steps = self._min_bounds
            self._min_bounds = None
        trainer.fit_loop.epoch_loop.__dict__.pop("_update_learning_rates", None)
        trainer.fit_loop.epoch_loop.__dict__.pop("_should_check_val_fx", None)
        trainer.fit_loop.epoch_loop.__dict__.pop("reset", None)
        trainer.fit_loop.__dict__.pop("setup_data", None)
        if trainer.__dict__.pop(_PROVIDER, None) is not None:
            trainer.__class__ = type(trainer).__bases__[0]
        self._trainer = None

    # ------------------------------------------------------------------------------ readings
    def setting(self, name: str) -> Any:
        """The user's ``trainer.<name>``, also while Lightning loads the training data without it (None: the Trainer
        has no such attribute, as ``val_check_interval`` when it is a time)."""
        return self._hidden[name] if name in self._hidden else getattr(self._trainer, name, None)

    def stepping_batches(self) -> float | None:
        """``trainer.estimated_stepping_batches``: the fit's length in B0-steps (None: Lightning's own count)."""
        trainer = self._trainer
        assert trainer is not None
        if trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()  # as Lightning's own property does
        if self.run is None:
            return None
        length = self.run.bounds.fit_length()
        if length.epoch_samples is None and math.isinf(length.stepping_batches):
            # Lightning answers `max_steps` here, -1, which a scheduler takes for a length
            raise RuntimeError(
                "`trainer.estimated_stepping_batches` was asked for (a learning-rate schedule's length, usually), but"
                " the training data is a stream, whose length is unknown, and neither `max_steps` nor SimiGrad's"
                f" `max_samples` bounds the fit (max_epochs={length.max_epochs}). Set `Trainer(max_steps=...)` (steps"
                " of B0 samples) or `SimiGrad(max_samples=...)`, or give the schedule its length yourself."
            )
        return length.stepping_batches

    def steps_done(self) -> int:
        """B0-steps of progress after the last optimizer step."""
        trainer, run = self._trainer, self.run
        assert trainer is not None and run is not None
        at_end = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        return run.bounds.fit_length().steps_done(*run.counters(), at_epoch_end=at_end)

    def end_fit(self) -> None:
        """The fit's sample budget (``max_steps`` in B0-steps, or ``max_samples``) is spent: stop after this step.

        Lightning's own ``max_steps`` ends a fit whatever ``min_epochs``/``min_steps`` say, while they hold back a
        ``should_stop``; so they are lifted for the rest of the fit (and restored in :meth:`detach`).
        """
        trainer = self._trainer
        assert trainer is not None
        trainer.should_stop = True
        fit_loop = trainer.fit_loop
        if self._min_bounds is None:
            self._min_bounds = (fit_loop.min_epochs, fit_loop.epoch_loop.min_steps)
        fit_loop.min_epochs, fit_loop.epoch_loop.min_steps = 0, None

    def record_step(self, epoch_done_before: int, epoch_done_after: int, total_before: int, total_after: int) -> None:
        """The samples an optimizer step just added (read by the validation cadence)."""
        self._last_step_span = (epoch_done_before, epoch_done_after, total_before, total_after)

    def start(self, run: Run, continued: bool = False) -> None:
        """Count in samples from here, for ``run``, from the step schedules' counts it holds (a checkpoint's, or an
        earlier fit's when the run is ``continued``)."""
        self._continue_restored = False
        self.run = run
        if run.without_state and not continued:
            # the checkpoint counted no B0-steps for its schedules: they continue from the state they were restored in
            self.continue_restored_schedules()

    def continue_restored_schedules(self) -> None:
        """The schedulers were restored from a checkpoint that counted no B0-steps for them (one written without
        SimiGrad): they continue from the state they were restored in, advancing with this fit's progress."""
        self._continue_restored = True

    # ------------------------------------------------------------------------------ Lightning's loops
    def _setup_data(self) -> None:
        trainer = self._trainer
        assert trainer is not None
        if not self.active:
            return self._originals["setup_data"]()
        # The sampler sizes epochs in samples, so Lightning must neither stop an epoch after a count of
        # micro-batches (`limit_train_batches`) nor refuse a fraction of a loader without a length
        # (`limit_train_batches`, `val_check_interval`): it loads the data as if unlimited, and the
        # limits are served in samples. Its own reading of both is restored at once.
        self._hidden = {}
        if trainer.limit_train_batches != 0:
            self._hidden["limit_train_batches"] = trainer.limit_train_batches
            trainer.limit_train_batches = 1.0
        # (a time-based `val_check_interval` leaves the Trainer without the attribute: nothing to hide)
        if isinstance(getattr(trainer, "val_check_interval", None), float):
            self._hidden["val_check_interval"] = trainer.val_check_interval
            trainer.val_check_interval = 1.0
        try:
            self._originals["setup_data"]()
        finally:
            for name, value in self._hidden.items():
                setattr(trainer, name, value)
            self._hidden = {}

    def _reset_epoch_loop(self) -> None:
        trainer = self._trainer
        assert trainer is not None
        epoch_loop = trainer.fit_loop.epoch_loop
        if self.active and epoch_loop.restarted_on_train_batch_end and epoch_loop.batch_progress.is_last_batch:
            # The checkpoint was written after the epoch's last batch, and the fit loop has moved on to the next
            # epoch. Lightning starts that epoch afresh when the batches it counted reach the loader's length;
            # without a length, do what it does then. The data iterator Lightning made while loading the data
            # belongs to the finished epoch (the fit loop had not moved on yet): make the new epoch's.
            epoch_loop.batch_progress.reset_on_run()
            epoch_loop.scheduler_progress.reset_on_run()
            epoch_loop.automatic_optimization.optim_progress.reset_on_run()
            epoch_loop.val_loop.batch_progress.total.reset()
            epoch_loop.reset_restart_stage()
            if trainer.fit_loop._data_fetcher is not None:
                if self.run is not None:
                    self.run.resumption.before_epoch()
                iter(trainer.fit_loop._data_fetcher)
        self._originals["reset"]()

    def start_window(self, samples: int) -> None:
        """Before a window of ``samples`` trains: schedules to the B0-step in its middle (see ``step_in_window``)."""
        run = self.run
        if self.schedule_by_samples and run is not None:
            self._advance_schedulers(run.bounds.fit_length().step_in_window(*run.counters(), samples))

    def _update_learning_rates(self, interval: str, update_plateau_schedulers: bool) -> None:
        if interval != "step" or update_plateau_schedulers or not self.schedule_by_samples or self.run is None:
            return self._originals["_update_learning_rates"](interval, update_plateau_schedulers)
        self._advance_schedulers(self.steps_done())
        return None

    def _advance_schedulers(self, done: int) -> None:
        """Step every step-interval scheduler until it has taken the steps due after ``done`` B0-steps: ``frequency``
        counts B0-steps within each epoch, as Lightning counts batches (:meth:`FitLength.scheduler_steps`)."""
        trainer, run = self._trainer, self.run
        assert trainer is not None
        if not trainer.lr_scheduler_configs or not trainer.lightning_module.automatic_optimization or run is None:
            return
        length = run.bounds.fit_length()
        configs = trainer.lr_scheduler_configs
        counts = run.scheduler_steps
        counts.cover(len(configs))
        progress = trainer.fit_loop.epoch_loop.scheduler_progress
        for index, config in enumerate(configs):
            if config.interval != "step" or config.reduce_on_plateau:
                continue
            if self._continue_restored:
                counts.set(index, length.scheduler_steps(done, config.frequency))
                continue
            due = length.scheduler_steps(done, config.frequency) - counts.taken(index)
            for _ in range(max(due, 0)):
                progress.increment_ready()
                call._call_lightning_module_hook(trainer, "lr_scheduler_step", config.scheduler, None)
                progress.increment_completed()
                counts.set(index, counts.taken(index) + 1)
        self._continue_restored = False

    def _should_check_val_fx(self, data_fetcher: Any) -> bool:
        trainer = self._trainer
        assert trainer is not None
        epoch_loop = trainer.fit_loop.epoch_loop
        span, self._last_step_span = self._last_step_span, None
        if (
            self.run is None
            or epoch_loop.restarting
            # a stop the fit loop will carry out (not one `min_epochs`/`min_steps` hold back): Lightning validates there
            or (trainer.should_stop and trainer.fit_loop._can_stop_early)
            # an epoch without optimizer steps (StochasticWeightAveraging's BatchNorm epoch): Lightning's own rule
            or epoch_loop.automatic_optimization._skip_backward
            or not epoch_loop._should_check_val_epoch()
        ):
            return bool(self._originals["_should_check_val_fx"](data_fetcher))
        if span is None:
            return False  # validation only ever follows an optimizer step, never splits a window
        if getattr(trainer, "_val_check_time_interval", None) is not None:
            # a time interval: Lightning's rule, asked once a step has ended, as a fixed batch asks it between steps
            return bool(self._originals["_should_check_val_fx"](data_fetcher))
        interval = self.run.bounds.validation_interval()
        if interval is None:
            return bool(epoch_loop.batch_progress.is_last_batch)
        samples, within_epoch = interval
        before, after = (span[0], span[1]) if within_epoch else (span[2], span[3])
        return after // samples > before // samples


_PROVIDER = "_lightning_simigrad_stepping_batches"  # the Trainer instance attribute the property reads


def _counting_in_samples(trainer_class: type[pl.Trainer]) -> type[pl.Trainer]:
    """A subclass of ``trainer_class`` whose ``estimated_stepping_batches`` asks the attached SampleSchedules
    (one per class, so that Trainers of a class share it)."""
    if trainer_class in _SUBCLASSES:
        return _SUBCLASSES[trainer_class]
    lightnings = trainer_class.estimated_stepping_batches

    def estimated_stepping_batches(self: pl.Trainer) -> int | float:
        provider = self.__dict__.get(_PROVIDER)
        value = provider() if provider is not None else None
        return value if value is not None else lightnings.fget(self)  # type: ignore[attr-defined]

    estimated_stepping_batches.__doc__ = lightnings.__doc__
    subclass = type(
        trainer_class.__name__, (trainer_class,), {"estimated_stepping_batches": property(estimated_stepping_batches)}
    )
    _SUBCLASSES[trainer_class] = subclass
    return subclass


_SUBCLASSES: dict[type, type] = {}

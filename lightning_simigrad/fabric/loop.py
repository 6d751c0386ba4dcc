"""SimiGrad in a training loop written with Lightning Fabric: the loop, the model, the optimizer and the scheduler stay
the user's, and a few lines hand SimiGrad the rest.

.. code-block:: python

    simigrad = FabricSimiGrad(fabric, target_similarity=0.3, max_micro_batch_size=8)
    model, optimizer = fabric.setup(model, optimizer)
    simigrad.setup(model, optimizer, train_loader)    # a plain DataLoader: SimiGrad sets it up with Fabric
    state = {"model": model, "optimizer": optimizer, "simigrad": simigrad}
    # fabric.load(path, state) resumes here, step for step
    for window in simigrad.windows(max_epochs=3):     # one optimizer step each
        for batch in window:                          # this rank's micro-batches of the step
            with fabric.no_backward_sync(model, enabled=window.accumulating):
                fabric.backward(window.scale(loss_of(model, batch)))
        window.step(optimizer)                        # measured, decided, the LR factor applied, counted
        optimizer.zero_grad()
        scheduler.step()

Everything SimiGrad does is the Trainer integration's own, with the Trainer's parts replaced by the loop's: the
:class:`~lightning_simigrad.run.Run` (plan, measure, decide, commit), the windows drawn by the same adaptive sampler
(:func:`~lightning_simigrad.integration.data_source.adaptive_loader`), the measurement the same factory chooses
(:func:`~lightning_simigrad.measurement.factory.measurement_for`), the learning-rate factor applied around
``optimizer.step`` (:class:`~lightning_simigrad.integration.lr_scaler.StepLRScaler`), the metrics of every step
(:class:`~lightning_simigrad.integration.reporting.Reporting`, to ``fabric.log_dict``), and the checkpoint in the
Trainer's format, with every rank's generators, beside the loop's epoch (``fabric.save`` / ``fabric.load`` call
:meth:`FabricSimiGrad.state_dict` / :meth:`FabricSimiGrad.load_state_dict`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any, cast

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from lightning_simigrad.core.sample_counts import Limits
from lightning_simigrad.core.settings import Settings
from lightning_simigrad.fabric.facts import data_parallel, forward_module, parallelism_of
from lightning_simigrad.integration import streams
from lightning_simigrad.integration.data_source import MapSource, WeightsRead
from lightning_simigrad.integration.lr_scaler import StepLRScaler
from lightning_simigrad.integration.readings import add_every_rank
from lightning_simigrad.integration.reporting import Reporting
from lightning_simigrad.measurement.factory import Training, measurement_for
from lightning_simigrad.measurement.protocol import Attachment, loss_scale_of
from lightning_simigrad.run import MicroBatch, Run, Step
from lightning_simigrad.state.checkpoint import Saved, compose, validate_state
from lightning_simigrad.state.resume import Restart

__all__ = ["FabricSimiGrad", "FabricWindow"]


class FabricSimiGrad:
    """SimiGrad for a Fabric loop (see the module docstring for the loop).

    Args:
        fabric: the launched :class:`~lightning.fabric.Fabric`.
        target_similarity: as :class:`~lightning_simigrad.SimiGrad`'s.
        **arguments: :class:`~lightning_simigrad.SimiGrad`'s other arguments (``max_micro_batch_size``,
            ``initial_batch_size``, bounds, ``lengths``, ``loss_items``, the controller's, ``max_samples``, ...).

    Raises:
        ValueError: for any argument :class:`~lightning_simigrad.SimiGrad` refuses, with the same message.
    """

    def __init__(self, fabric: Fabric, target_similarity: float, **arguments: Any) -> None:
        self._begin(fabric, Settings(target_similarity, **arguments))

    @classmethod
    def following(cls, fabric: Fabric, schedule: Any) -> FabricSimiGrad:
        """A fixed schedule or a replay in a Fabric loop, as the Trainer takes a :class:`BatchSizeSchedule`:
        ``FabricSimiGrad.following(fabric, BatchSizeSchedule(linear_ramp(...), max_micro_batch_size=8))``, or
        ``BatchSizeSchedule.from_history(...)`` / ``from_trace(...)``. The loop is the same; the schedule decides
        each window's size, and the halves are measured and logged without acting on them.

        Raises:
            TypeError: when ``schedule`` is not a :class:`~lightning_simigrad.BatchSizeSchedule`.
        """
        from lightning_simigrad.batch_size_schedule import BatchSizeSchedule

        if not isinstance(schedule, BatchSizeSchedule):
            raise TypeError(
                f"`FabricSimiGrad.following(fabric, schedule)`: `schedule` must be a `BatchSizeSchedule`, got"
                f" {type(schedule).__name__}. Build it as for the Trainer: `BatchSizeSchedule(linear_ramp(start=64,"
                " end=1024, over=100_000), max_micro_batch_size=32)` or `BatchSizeSchedule.from_trace(path)`."
            )
        loop = cls.__new__(cls)
        cls._begin(loop, fabric, schedule.settings)
        return loop

    def _begin(self, fabric: Fabric, settings: Settings) -> None:
        self.fabric = fabric
        self.settings = settings
        self.reporting = Reporting(self.settings.history_size)
        self.lr = StepLRScaler()
        self.run: Run | None = None
        self.epoch = 0  # the loop's epoch: the next one to train, or the one being trained
        self._weights = WeightsRead()
        self._saved: Saved | None = None
        self._loaded_loop: dict[str, Any] | None = None
        self._model: Any = None
        self._loader: DataLoader | None = None
        self._window: FabricWindow | None = None

    # ------------------------------------------------------------------------------ setting up
    def setup(self, model: Any, optimizer: Any, loader: DataLoader) -> None:
        """The model and optimizer as ``fabric.setup`` returned them, and the training DataLoader as the user made it
        (its dataset, batch size, sampler's shuffling, workers): SimiGrad draws its windows from it."""
        if streams.is_stream(loader):
            raise ValueError(
                "`FabricSimiGrad.setup`: the training DataLoader is a stream (an IterableDataset). Fabric loops are"
                " served over map-style datasets so far; under the Trainer, `SimiGrad` serves streams."
            )
        if getattr(loader, "batch_size", None) is None:
            raise ValueError(
                "`FabricSimiGrad.setup`: give the DataLoader a `batch_size` (the most samples a micro-batch takes"
                " unless `max_micro_batch_size` says otherwise), not a `batch_sampler`."
            )
        owned = {id(p) for p in model.parameters()}
        stale = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in owned]
        if stale:  # the optimizer would step (and zero) parameters the model no longer trains
            raise ValueError(
                f"`FabricSimiGrad.setup`: {len(stale)} of the optimizer's parameters are not the model's. A strategy"
                " that shards the model (FSDP2's `ModelParallelStrategy`) replaces its parameters: set the model up"
                " first, then make the optimizer over `model.parameters()` (`model = fabric.setup_module(model)`;"
                " `optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))`)."
            )
        self._model, self._loader = model, loader
        self.lr.detach()
        self.lr.attach(getattr(optimizer, "optimizer", optimizer))  # Fabric's wrapper steps the optimizer it holds

    def windows(self, max_epochs: int = -1, max_steps: int = -1) -> Iterator[FabricWindow]:
        """The fit's optimizer steps, one window each, epoch after epoch, until ``max_epochs`` epochs, ``max_steps``
        steps (of B0 samples, as under the Trainer with ``schedule_by_samples``) or ``max_samples`` are trained."""
        if self._model is None or self._loader is None:
            raise RuntimeError("Call `FabricSimiGrad.setup(model, optimizer, loader)` before `windows()`.")
        run, loader = self._start(max_epochs, max_steps)
        params = list(self._model.parameters())
        world = run.world_size
        run.measurement.attach(Attachment(forward_module(self._model), params, world))
        # `max_steps` counts steps of B0 samples (the run's budget) unless `schedule_by_samples=False`: then optimizer
        # steps, which the Trainer counts itself and the loop counts here
        steps_left = (
            (lambda: run.counts.steps < max_steps)
            if max_steps >= 0 and not self.settings.schedule_by_samples
            else (lambda: True)
        )
        try:
            while not run.done and steps_left() and (max_epochs < 0 or self.epoch < max_epochs):
                run.start_epoch()
                run.resumption.before_epoch()  # a checkpoint written at an epoch's end: the generators go back now
                batches = iter(loader)
                for first in batches:
                    self._window = FabricWindow(self, run, params, first, batches)
                    yield self._window
                    if not self._window.stepped:
                        raise RuntimeError(
                            "A window of `FabricSimiGrad.windows()` ended without `window.step(optimizer)`: every"
                            " window is one optimizer step. Call it after the window's micro-batches."
                        )
                    if run.done or not steps_left():
                        return  # stopped inside the epoch: a checkpoint written now continues it
                run.end_epoch()
                self.epoch += 1
        finally:
            self._window = None
            run.close()

    def _start(self, max_epochs: int, max_steps: int) -> tuple[Run, DataLoader]:
        """The fit's run (continued where a loaded checkpoint left it) and the loader drawing its windows."""
        fabric, loader, settings = self.fabric, self._loader, self.settings
        assert loader is not None
        world, rank = data_parallel(fabric)
        source = MapSource(loader, loader.sampler, settings, self._weights)
        limits = Limits(max_steps=max_steps, max_epochs=max_epochs, val_check_interval=None, validates=False)
        restart = self._restart() if self._saved is not None else None
        seed = int(fabric.broadcast(int(torch.randint(0, 2**31 - 1, (1,)).item()), src=0))
        b0 = self._saved.facts.initial_batch_size if self._saved is not None else settings.initial_batch_size
        assert loader.batch_size is not None
        run = Run(
            settings,
            source.data,
            limits,
            world,
            rank,
            seed,
            b0 or loader.batch_size * world,
            epoch=lambda: self.epoch,
            measurement=measurement_for(parallelism_of(fabric)),
            restart=restart,
            warn=_warn_once_on(fabric),
            info=fabric.print,
        )
        self.run, self._saved = run, None
        adapted = source.adapt(run, restart)
        # one loader in, one out (a `_FabricDataLoader`, which moves each batch to the device)
        return run, cast(DataLoader, fabric.setup_dataloaders(adapted, use_distributed_sampler=False))

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """SimiGrad's state in the Trainer's checkpoint format, every rank's generators in it, and the loop's epoch: a
        collective (``fabric.save`` calls it on every rank)."""
        run = self.run
        if run is None:
            raise RuntimeError("`FabricSimiGrad.state_dict()` before `windows()` started: there is no state yet.")
        state = compose(run.state_dict())
        add_every_rank(state, run, None)
        # the counts stand in the epoch the schedule's piece names; it is finished where all its samples are
        epoch_samples = run.bounds.epoch_samples()
        at_end = not run.schedule.current.inside_window and (
            epoch_samples is not None and run.counts.epoch_samples_done >= epoch_samples
        )
        return {"simigrad": state, "loop": {"at_epoch_end": bool(at_end)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's state (``fabric.load``), validated now; the next :meth:`windows` continues from it."""
        if not isinstance(state, dict) or set(state) != {"simigrad", "loop"}:
            raise ValueError(
                "`FabricSimiGrad.load_state_dict`: not a FabricSimiGrad state (expected the keys 'simigrad' and"
                f" 'loop', got {sorted(state) if isinstance(state, dict) else type(state).__name__})."
            )
        loop = state["loop"]
        if not (isinstance(loop, dict) and isinstance(loop.get("at_epoch_end"), bool)):
            raise ValueError(f"`FabricSimiGrad.load_state_dict`: `loop` = {loop!r} must be {{'at_epoch_end': a bool}}.")
        self._saved = Saved.of(validate_state(state["simigrad"], "the Fabric checkpoint"))
        self._loaded_loop = dict(loop)

    def _restart(self) -> Restart:
        assert self._saved is not None and self._loaded_loop is not None
        at_end = bool(self._loaded_loop["at_epoch_end"])
        epoch = self._saved.schedule.epoch + (1 if at_end else 0)
        self.epoch = epoch
        counts = self._saved.counts
        return Restart("the Fabric checkpoint", self._saved, epoch, at_end, 0, counts.steps)

    # ------------------------------------------------------------------------------ readings
    @property
    def history(self) -> list[dict[str, float]]:
        """One row per optimizer step, as :attr:`lightning_simigrad.SimiGrad.history`."""
        return self.reporting.history

    @property
    def batch_size(self) -> int | None:
        """The batch size the next window asks for."""
        return self.run.schedule.batch_size if self.run is not None else None


class FabricWindow:
    """One optimizer step: iterate it for this rank's micro-batches, then :meth:`step`.

    While a micro-batch is being trained, :attr:`accumulating` says whether its backward may skip the gradient's
    synchronisation (``fabric.no_backward_sync(model, enabled=window.accumulating)``) and :meth:`scale` weighs its
    loss so that every sample of the step (every loss item, with ``loss_items``) weighs exactly ``1/N``.
    """

    def __init__(self, loop: FabricSimiGrad, run: Run, params: list[Any], first: Any, batches: Iterator[Any]) -> None:
        self._loop, self._run, self._params = loop, run, params
        self._first: Any = first
        self._batches = batches
        self._micro: MicroBatch | None = None
        self._step: Step | None = None
        self._reduces_always = parallelism_of(loop.fabric).training is Training.FSDP2  # it reduces every micro-batch
        self.stepped = False

    def __iter__(self) -> Iterator[Any]:
        if self._first is None:
            raise RuntimeError("A window's micro-batches are iterated once.")
        batch, self._first = self._first, None
        run, lr = self._run, self._loop.lr
        while True:
            micro = run.start_micro_batch(self._params, batch)
            self._micro, lr.factor = micro, micro.lr_factor
            yield batch
            run.after_backward(self._params)  # the loop asks for the next micro-batch after this one's backward
            if micro.last:
                return
            batch = next(self._batches)

    @property
    def accumulating(self) -> bool:
        """The micro-batch being trained may skip the gradient's synchronisation across ranks."""
        micro = self._micro
        return not (micro is None or micro.last or micro.reduces or self._reduces_always)

    def scale(self, loss: Any) -> Any:
        """The micro-batch's mean loss, weighed for the step (``fabric.backward(window.scale(loss))``)."""
        if self._micro is None:
            raise RuntimeError("`window.scale(loss)` inside the window's loop over its micro-batches.")
        divisor = self._micro.loss_divisor
        return loss * 0.0 if math.isinf(divisor) else loss / divisor  # a zero-weight padding sample adds nothing

    def finish(self) -> Step:
        """Measure the halves, decide the next batch and count the step; the gradient is then the mean over exactly
        the step's samples (clip it here if you clip). :meth:`step` calls it when you have not."""
        if self._step is not None:
            return self._step
        if self._micro is None or not self._micro.last:
            raise RuntimeError("`window.finish()` after the window's last micro-batch and its backward.")
        loop, run = self._loop, self._run
        scale = loss_scale_of(getattr(loop.fabric.strategy.precision, "scaler", None))
        step = run.finish_step(self._params, scale)
        loop.lr.factor = step.lr_factor
        b0_steps = math.ceil(run.counts.weight_seen / run.b0)
        row = loop.reporting.record(step, run, loop.lr.applied_lr(), b0_steps)
        loop.fabric.log_dict(row, step=step.index)
        self._step = step
        return step

    def step(self, optimizer: Any) -> Step:
        """:meth:`finish`, then ``optimizer.step()`` with the step's learning-rate factor (the scheduler's own rate
        comes back after it)."""
        step = self.finish()
        optimizer.step()
        self.stepped = True
        return step

    @property
    def batch_size(self) -> int:
        """The window's batch size, in what batch sizes count."""
        window = self._run.window
        return window.weight if window is not None else 0


def _warn_once_on(fabric: Fabric) -> Any:
    def warn(message: str) -> None:
        if fabric.is_global_zero:
            warnings.warn(message, stacklevel=3)

    return warn

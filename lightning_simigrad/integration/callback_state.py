"""The SimiGrad callback's state as others see it: the readings users take, the checkpoint, a spawned fit's results.

During a fit in this process the readings come from its :class:`~lightning_simigrad.run.Run` and the
:class:`~lightning_simigrad.integration.reporting.Reporting`. After a ``ddp_spawn`` fit they come from the state
rank 0's copy of the callback sent back (:mod:`lightning_simigrad.integration.spawn_results`), received the first
time one of them is read. A checkpoint holds the run's state (:mod:`lightning_simigrad.state.checkpoint`), the
step schedules' counts and every rank's generator states; a restored one is validated before anything trains
and makes the next run.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_simigrad.core.controller import BatchSizeController
from lightning_simigrad.core.settings import Settings
from lightning_simigrad.data.schedule import WindowSchedule
from lightning_simigrad.integration.progress import SampleProgress
from lightning_simigrad.integration.reporting import Reporting
from lightning_simigrad.integration.spawn_results import Origin
from lightning_simigrad.run import Run
from lightning_simigrad.state.checkpoint import validate_state
from lightning_simigrad.state.rng import all_ranks_rng_states

__all__ = ["CallbackState"]


class CallbackState(Callback):
    """The readings, checkpoint hooks and spawned-fit state of :class:`~lightning_simigrad.SimiGrad` (its base)."""

    settings: Settings
    run: Run | None
    reporting: Reporting
    _origin: Origin
    _finished: dict[str, Any]  # the state of a fit that ran in spawned processes
    _finished_summary: dict[str, int]
    _progress: SampleProgress
    _trainer: pl.Trainer | None
    _restored: dict[str, Any] | None  # SimiGrad's state in the checkpoint the fit resumes from
    _resuming: bool  # the fit resumes from a checkpoint (with or without SimiGrad's state)

    @property
    def history(self) -> list[dict[str, float]]:
        """One row per optimizer step (the latest ``history_size``): the step and the metrics without prefix."""
        self._receive()
        return self.reporting.history

    @property
    def batch_size(self) -> int | None:
        """The global batch size the next window will be planned with (None before fit)."""
        return self._state().get("batch_size")

    @property
    def samples_seen(self) -> int:
        """Samples the fit's optimizer steps have averaged."""
        return int(self._state().get("samples_seen", 0))

    @property
    def steps(self) -> int:
        """Optimizer steps the fit has taken."""
        return int(self._state().get("steps", 0))

    @property
    def controller(self) -> BatchSizeController | None:
        """The batch-size controller (its smoothed similarity and noise scale)."""
        self._receive()
        if self.run is not None:
            return self.run.controller
        if "controller" not in self._finished:
            return None
        controller = BatchSizeController(**self.settings.controller_args(self._finished["initial_batch_size"]))
        controller.load_state_dict(self._finished["controller"])
        return controller

    @property
    def schedule(self) -> WindowSchedule | None:
        """The window schedule the sampler plans from (None outside a fit in this process)."""
        return self.run.schedule if self.run is not None else None

    @property
    def local_samples(self) -> int:
        """Samples this rank contributes in the current micro-batch (0: a zero-weight padding sample)."""
        return self.run.local_samples if self.run is not None else 0

    def summary(self) -> dict[str, int]:
        """The fit so far in numbers: optimizer steps, samples, batch-size range, and the steps B0 would take."""
        self._receive()
        return self.reporting.summary(self.run) if self.run is not None else dict(self._finished_summary)

    # ------------------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.run is None:
            return dict(self._restored or self._state())
        return {**self.run.state_dict(), "progress": self._progress.state_dict()}

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state and self.run is not None:
            # every rank's: a collective, on all ranks as Lightning's own saving is (it ends in a barrier)
            state["rng"] = all_ranks_rng_states(self.run.generators_to_save())

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning calls `load_state_dict` only when the checkpoint holds a state for this callback
        self._resuming, self._restored = True, None
        if self.run is not None:
            self.run.resumption.forget()  # an earlier resume's, if its fit ended before a batch
        self.run = None  # made again from the checkpoint's state when the data loads

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer = self._trainer
        where = str(trainer.ckpt_path) if trainer is not None and trainer.ckpt_path else "the checkpoint"
        self._restored = dict(validate_state(state_dict, where))
        self.run = None  # made again from the checkpoint's state when the data loads

    # ------------------------------------------------------------------------------ ddp_spawn
    def spawn_state(self) -> dict[str, Any]:
        """What the launching process's copy of this callback needs after a ``ddp_spawn`` fit."""
        summary = self.reporting.summary(self.run) if self.run is not None else {}
        return {"state": self.state_dict(), "history": self.reporting.history, "summary": summary}

    def load_spawn_state(self, state: dict[str, Any]) -> None:
        self.reporting.history = list(state["history"])
        self._finished, self._finished_summary = dict(state["state"]), dict(state["summary"])
        self.run = None

    def _receive(self) -> None:
        state = self._origin.receive()
        if state is not None:
            self.load_spawn_state(state)

    def _state(self) -> dict[str, Any]:
        self._receive()
        if self.run is not None:
            return {**self.run.schedule.state_dict(), "samples_seen": self.run.samples_seen, "steps": self.run.steps}
        return self._finished

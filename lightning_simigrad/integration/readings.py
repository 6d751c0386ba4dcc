"""The SimiGrad callback as others see it: the readings users take, the checkpoint, a spawned fit's results.

During a fit in this process the readings come from the fit's run (:mod:`~lightning_simigrad.integration.session`)
and the :class:`~lightning_simigrad.integration.reporting.Reporting`; after it, from the run the fit left. After a
``ddp_spawn`` fit they come from the state rank 0's copy of the callback sent back
(:mod:`lightning_simigrad.integration.spawn_results`), received the first time one of them is read. A checkpoint
holds the run's components' pieces (:mod:`lightning_simigrad.state.checkpoint`) and every rank's generator states;
a restored one is validated before anything trains and makes the next run.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_simigrad.core.controller import BatchSizeController
from lightning_simigrad.core.settings import Settings
from lightning_simigrad.data.schedule import WindowSchedule
from lightning_simigrad.integration.reporting import Reporting
from lightning_simigrad.integration.session import Carried, FitSession, Resume
from lightning_simigrad.integration.spawn_results import Origin
from lightning_simigrad.run import Run
from lightning_simigrad.state.checkpoint import compose, validate_state
from lightning_simigrad.state.gather import every_rank

__all__ = ["Readings"]


class Readings(Callback):
    """The readings, checkpoint hooks and spawned-fit state of :class:`~lightning_simigrad.SimiGrad` (its base).

    Args:
        settings: the callback's settings, validated.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.reporting = Reporting(settings.history_size)
        self._session: FitSession | None = None  # the fit being run in this process
        self._carried = Carried()  # what the last fit in this process left: its run, which a next fit continues
        self._finished: dict[str, Any] = {}  # the state of a fit that ran in spawned processes, and its summary
        self._finished_summary: dict[str, int] = {}
        self._origin = Origin.of(self)

    @property
    def run(self) -> Run | None:
        """The run of the fit being trained, or of the last fit in this process (None before any)."""
        if self._session is not None and self._session.started:
            return self._session.run
        return self._carried.run

    @property
    def history(self) -> list[dict[str, float]]:
        """One row per optimizer step (the latest ``history_size``): the step and the metrics without prefix."""
        self._receive()
        return self.reporting.history

    @property
    def batch_size(self) -> int | None:
        """The global batch size the next window will be planned with (None before fit)."""
        return self._state().get("schedule", {}).get("batch_size")

    @property
    def samples_seen(self) -> int:
        """Samples the fit's optimizer steps have averaged."""
        return int(self._state().get("counts", {}).get("samples_seen", 0))

    @property
    def steps(self) -> int:
        """Optimizer steps the fit has taken."""
        return int(self._state().get("counts", {}).get("steps", 0))

    @property
    def controller(self) -> BatchSizeController | None:
        """The batch-size controller (its smoothed similarity and noise scale)."""
        self._receive()
        run = self.run
        if run is not None:
            return run.controller
        if "controller" not in self._finished:
            return None
        controller = BatchSizeController(**self.settings.controller_args(self._finished["run"]["initial_batch_size"]))
        controller.load_state_dict(self._finished["controller"])
        return controller

    @property
    def schedule(self) -> WindowSchedule | None:
        """The window schedule the data path plans from (None outside a fit in this process)."""
        run = self.run
        return run.schedule if run is not None else None

    @property
    def local_samples(self) -> int:
        """Samples this rank contributes in the current micro-batch (0: a zero-weight padding sample)."""
        run = self.run
        return run.local_samples if run is not None else 0

    def summary(self) -> dict[str, int]:
        """The fit so far in numbers: optimizer steps, samples, batch-size range, and the steps B0 would take."""
        self._receive()
        run = self.run
        return self.reporting.summary(run) if run is not None else dict(self._finished_summary)

    # ------------------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        run = self.run
        if run is not None:
            return compose(run.state_dict())
        resume = self._session.resume if self._session is not None else None
        if resume is not None and resume.state is not None:  # restored, and not trained from yet
            return dict(resume.state)
        return dict(self._state())

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        run = self.run
        if state and run is not None:
            # every rank's: a collective, on all ranks as Lightning's own saving is (it ends in a barrier)
            state["rng"] = every_rank(run.generators_to_save())
            # the fit's stream, or the last fit's (`trainer.save_checkpoint` after `fit`)
            stream = self._session.stream if self._session is not None else self._carried.stream
            if stream is not None and stream.stateful:  # where each rank's stream resumes
                positions = every_rank(stream.position())
                state["stream"] = [p.loader_state if p is not None else None for p in positions]
                state["stream_skip"] = [p.skip if p is not None else 0 for p in positions]

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning calls `load_state_dict` only when the checkpoint holds a state for this callback
        self._carried = Carried(None, self._carried.tuned_from)
        if self._session is not None:
            self._session.resume_from(Resume(None))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer = self._session.trainer if self._session is not None else None
        where = str(trainer.ckpt_path) if trainer is not None and trainer.ckpt_path else "the checkpoint"
        resume = Resume(validate_state(state_dict, where))
        self._carried = Carried(None, self._carried.tuned_from)
        if self._session is not None:
            self._session.resume_from(resume)

    # ------------------------------------------------------------------------------ ddp_spawn
    def spawn_state(self) -> dict[str, Any]:
        """What the launching process's copy of this callback needs after a ``ddp_spawn`` fit."""
        run = self.run
        summary = self.reporting.summary(run) if run is not None else {}
        return {"state": self.state_dict(), "history": self.reporting.history, "summary": summary}

    def load_spawn_state(self, state: dict[str, Any]) -> None:
        self.reporting.history = list(state["history"])
        self._finished, self._finished_summary = dict(state["state"]), dict(state["summary"])
        self._carried = Carried(None, self._carried.tuned_from)

    def _receive(self) -> None:
        state = self._origin.receive()
        if state is not None:
            self.load_spawn_state(state)

    def _state(self) -> dict[str, Any]:
        self._receive()
        run = self.run
        if run is not None:
            return compose(run.state_dict())
        return self._finished

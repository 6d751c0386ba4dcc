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
from lightning_simigrad.exchange import gather_objects
from lightning_simigrad.integration.data_source import Source
from lightning_simigrad.integration.reporting import Reporting
from lightning_simigrad.integration.session import Carried, FitSession
from lightning_simigrad.integration.spawn_results import Origin
from lightning_simigrad.run import Run
from lightning_simigrad.state.checkpoint import Saved, compose, validate_state, with_every_rank

__all__ = ["Readings", "add_every_rank"]


def add_every_rank(state: dict[str, Any], run: Run, source: Source | None) -> None:
    """Every rank's generator states (and, where the source keeps one, its position) into ``state``: a collective,
    to be called on every rank at once."""
    keeps = source is not None and source.keeps_position
    position = source.position() if source is not None and keeps else None
    pieces = gather_objects((run.generators_to_save(), position))  # one gather, every rank's pieces
    with_every_rank(state, [rng for rng, _ in pieces], [p for _, p in pieces] if keeps else None)


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
        self._finished: Saved | None = None  # the state of a fit that ran in spawned processes, and its summary
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
        saved = self._state()
        return saved.schedule.batch_size if saved is not None else None

    @property
    def samples_seen(self) -> int:
        """Samples the fit's optimizer steps have averaged."""
        saved = self._state()
        return saved.counts.samples_seen if saved is not None else 0

    @property
    def steps(self) -> int:
        """Optimizer steps the fit has taken."""
        saved = self._state()
        return saved.counts.steps if saved is not None else 0

    @property
    def controller(self) -> BatchSizeController | None:
        """The batch-size controller (its smoothed similarity and noise scale)."""
        self._receive()
        run = self.run
        if run is not None:
            return run.controller
        if self._finished is None:
            return None
        controller = BatchSizeController(**self.settings.controller_args(self._finished.facts.initial_batch_size))
        controller.load_state_dict(self._finished.controller)
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
        saved = self._session.saved if self._session is not None else None
        if saved is not None:  # restored, and not trained from yet
            return saved.state_dict()
        finished = self._state()
        return finished.state_dict() if finished is not None else {}

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        run = self.run
        if state and run is not None:
            # every rank's: a collective, on all ranks as Lightning's own saving is (it ends in a barrier). The fit's
            # source, or the last fit's (`trainer.save_checkpoint` after `fit`): where each rank's resumes
            source = self._session.source if self._session is not None else self._carried.source
            add_every_rank(state, run, source)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning calls `load_state_dict` only when the checkpoint holds a state for this callback
        self._carried = Carried(None, self._carried.tuned_from)
        if self._session is not None:
            self._session.resume_from(None)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer = self._session.trainer if self._session is not None else None
        where = str(trainer.ckpt_path) if trainer is not None and trainer.ckpt_path else "the checkpoint"
        saved = Saved.of(validate_state(state_dict, where))
        self._carried = Carried(None, self._carried.tuned_from)
        if self._session is not None:
            self._session.resume_from(saved)

    # ------------------------------------------------------------------------------ ddp_spawn
    def spawn_state(self) -> dict[str, Any]:
        """What the launching process's copy of this callback needs after a ``ddp_spawn`` fit."""
        run = self.run
        summary = self.reporting.summary(run) if run is not None else {}
        return {"state": self.state_dict(), "history": self.reporting.history, "summary": summary}

    def load_spawn_state(self, state: dict[str, Any]) -> None:
        self.reporting.history = list(state["history"])
        self._finished = Saved.of(state["state"]) if state["state"] else None
        self._finished_summary = dict(state["summary"])
        self._carried = Carried(None, self._carried.tuned_from)

    def _receive(self) -> None:
        state = self._origin.receive()
        if state is not None:
            self.load_spawn_state(state)

    def _state(self) -> Saved | None:
        """The fit's state: the run's, or a spawned fit's (None before any)."""
        self._receive()
        run = self.run
        if run is not None:
            return Saved.of(compose(run.state_dict()))
        return self._finished

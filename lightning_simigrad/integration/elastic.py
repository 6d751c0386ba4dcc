"""Devices that follow the batch, under Lightning: the world size each step's batch wants, the request for it at a
step's boundary, and an exact checkpoint when TorchElastic stops the workers.

:class:`ElasticWatch` is the fit session's part for :class:`~lightning_simigrad.core.world.Elastic`. After every
optimizer step it reads the batch the next step asks for and the micro-batch cap, both in the batch's unit, and
updates the wanted world (:class:`~lightning_simigrad.core.world.WorldWanted`); every rank computes it from numbers
every rank shares, so the ranks agree without a collective. When the
:class:`~lightning_simigrad.core.world.ResizeTrigger` fires, the step's ``on_train_batch_end`` (after the optimizer
step, at the window's boundary) writes the checkpoint on every rank, then rank zero writes the request, and the fit
stops, continues, or hands the request to the user's function.

SIGTERM: Lightning's own handler marks ``trainer.received_sigterm``; with several ranks its training loop agrees on it
(rank zero's flag, broadcast before every micro-batch) and raises ``SIGTERMException`` on every rank at the same
micro-batch; on one rank it raises only at the epoch's end, so the watch raises it after the micro-batch under way.
Either way the checkpoint is written from ``on_exception``, on every rank at once, where the fit stopped: a checkpoint
inside a window retrains that window from its start after the restart, so no optimizer step that finished is lost and
none is counted twice. Finishing the window first could outlast the launcher's grace period before SIGKILL (a window
may be many micro-batches); the unfinished window is all that is trained again.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_simigrad.core.world import Elastic, ResizeRequest, ResizeTrigger, WorldWanted
from lightning_simigrad.run import Run, Step

__all__ = ["ElasticWatch"]


class ElasticWatch:
    """The wanted world of one fit, and what it does when the world should change (see the module docstring).

    Args:
        elastic: the user's settings.
        trainer: the fit's (its devices per node and world size are the current world's).
    """

    def __init__(self, elastic: Elastic, trainer: pl.Trainer) -> None:
        self.elastic = elastic
        self.devices_per_node = elastic.devices_per_node or trainer.num_devices
        self.current_nodes = max(1, math.ceil(trainer.world_size / self.devices_per_node))
        self.trigger = ResizeTrigger(elastic.resize_factor, elastic.patience)
        self.wanted: WorldWanted | None = None  # made at the first step, when the micro-batch's weight is known
        self.requested: ResizeRequest | None = None  # the request the fit has written, if any
        self._pending: str | None = None  # the reason for a request the step's end writes

    @property
    def world_size_wanted(self) -> int:
        return self.wanted.world if self.wanted is not None else self.current_nodes * self.devices_per_node

    def step(self, run: Run, step: Step) -> int:
        """After optimizer step ``step``: the world size the next step's batch wants (a request is then pending where
        the trigger fires)."""
        per_sample = step.weight / step.samples if step.samples else 1.0
        micro = run.settings.batch_unit.max_slot_weight or run.schedule.max_micro_batch_size * per_sample
        if self.wanted is None:
            least = run.schedule.min_micro_batches * per_sample  # a measured step needs this on every rank
            rule = self.elastic.rule(self.devices_per_node, least)
            self.wanted = WorldWanted(rule, self.current_nodes, self.elastic.shrink_at)
        batch = run.schedule.batch_size  # what the next step asks for, in the batch's unit
        nodes = self.wanted.update(batch, micro)
        already = self.requested is not None and self.requested.nodes == nodes
        if self.trigger.update(nodes, self.current_nodes) and not already and self._pending is None:
            accumulation = math.ceil(math.ceil(batch / micro) / (self.current_nodes * self.devices_per_node))
            self._pending = (
                f"the batch of {batch} {run.settings.batch_unit.name} in micro-batches of at most {micro:g} takes"
                f" {accumulation} a rank on {self.current_nodes} node(s), above max_accumulation ="
                f" {self.elastic.max_accumulation}"
                if nodes > self.current_nodes
                else f"the batch of {batch} {run.settings.batch_unit.name} fits on {nodes} node(s) with at most"
                f" max_accumulation = {self.elastic.max_accumulation} micro-batches a rank"
            )
        return self.world_size_wanted

    def batch_end(self, trainer: pl.Trainer, run: Run) -> None:
        """After every micro-batch: write a pending request at the step's boundary; on one rank, stop at a SIGTERM."""
        if self._pending is not None and not run.schedule.current.inside_window:
            self._request(trainer, run, self._pending)
            self._pending = None
        if self.elastic.save_on_sigterm and trainer.world_size == 1 and trainer.received_sigterm:
            raise SIGTERMException()  # several ranks: Lightning's loop raises it, on every rank at once

    def on_exception(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """A SIGTERM stopped the fit (on every rank at the same micro-batch): the exact checkpoint, where it stopped."""
        if self.elastic.save_on_sigterm and isinstance(exception, SIGTERMException):
            path = self.checkpoint_path(trainer)
            trainer.save_checkpoint(path)
            rank_zero_info(
                f"SimiGrad: SIGTERM received; saved an exact checkpoint at step {trainer.global_step}: {path}"
            )

    def checkpoint_path(self, trainer: pl.Trainer) -> Path:
        return self._directory(trainer) / Elastic.CHECKPOINT

    def request_path(self, trainer: pl.Trainer) -> Path:
        return self._directory(trainer) / Elastic.REQUEST

    def _directory(self, trainer: pl.Trainer) -> Path:
        if self.elastic.dirpath is not None:
            return Path(self.elastic.dirpath)
        checkpoint = next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)), None)
        if checkpoint is not None and checkpoint.dirpath is not None:  # `ckpt_path="last"` looks there
            return Path(checkpoint.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"

    def _request(self, trainer: pl.Trainer, run: Run, reason: str) -> None:
        checkpoint = self.checkpoint_path(trainer)
        trainer.save_checkpoint(checkpoint)  # every rank: the strategy gathers what it must
        assert self.wanted is not None
        request = ResizeRequest(
            nodes=self.wanted.nodes,
            world_size=self.wanted.world,
            devices_per_node=self.devices_per_node,
            checkpoint=os.fspath(checkpoint.resolve()),
            step=run.counts.steps,
            samples_seen=run.counts.samples_seen,
            batch_size=run.schedule.batch_size,
            current_nodes=self.current_nodes,
            current_world_size=trainer.world_size,
            reason=reason,
        )
        if trainer.is_global_zero:
            request.write(self.request_path(trainer))
        trainer.strategy.barrier("simigrad-resize-request")  # the request exists before any rank acts on it
        self.requested = request
        rank_zero_info(
            f"SimiGrad: asking for {request.nodes} node(s) ({request.world_size} ranks) at step {request.step}:"
            f" {reason}. Checkpoint {request.checkpoint}; request {self.request_path(trainer)}."
        )
        if callable(self.elastic.on_request):
            self.elastic.on_request(request)
        elif self.elastic.on_request == "stop":
            trainer.should_stop = True

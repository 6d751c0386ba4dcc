"""A ``ddp_spawn`` fit's SimiGrad state, carried back to the process that called ``fit``.

With ``strategy="ddp_spawn"`` the fit runs in child processes, on copies of the callbacks. Lightning
sends rank 0's weights and ``callback_metrics`` back through its launcher's ``get_extra_results`` (in
the child) and ``update_main_process_results`` (in the launching process). :func:`install` adds the
state of every callback that implements the small protocol below to that same channel, so the
``SimiGrad`` object the user holds reads the fit's history, batch size and controller afterwards, as it
does after any other fit.

The launcher's two methods are wrapped once per process, at import (the children import this module
when they unpickle the callbacks), and delegate to Lightning's own: other fields pass untouched.

The states travel through a temporary file, as Lightning's weights do, and only its path through the
launcher's result queue: the launching process reads that queue only after the children have exited, so a
child putting more than the pipe's buffer (64 KiB on Linux; a ``history`` of some 600 steps) would block
forever.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

__all__ = ["SpawnState", "install"]

_KEY = "lightning_simigrad"


@runtime_checkable
class SpawnState(Protocol):
    """A callback whose state should reach the launching process after a spawned fit."""

    def spawn_state(self) -> dict[str, Any]: ...

    def load_spawn_state(self, state: dict[str, Any]) -> None: ...


def _carriers(trainer: pl.Trainer) -> list[SpawnState]:
    return [c for c in trainer.callbacks if isinstance(c, SpawnState)]  # type: ignore[attr-defined]


def install() -> None:
    """Wrap the launcher's result methods (idempotent)."""
    launcher = _MultiProcessingLauncher
    if getattr(launcher.get_extra_results, "_lightning_simigrad", False):
        return
    get_extra_results, update_main_process_results = launcher.get_extra_results, launcher.update_main_process_results

    def get_extra_results_with_states(self: Any, trainer: pl.Trainer) -> dict[str, Any]:
        extra = get_extra_results(self, trainer)
        states = [c.spawn_state() for c in _carriers(trainer)]
        if states:
            path = os.path.join(tempfile.mkdtemp(), "spawn_states.pkl")  # a folder of its own, as for the weights
            with open(path, "wb") as file:
                pickle.dump(states, file)
            extra[_KEY] = path
        return extra

    def update_main_process_results_with_states(self: Any, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        path = extra.pop(_KEY, None)
        try:
            update_main_process_results(self, trainer, extra)
            if path is None:
                return
            with open(path, "rb") as file:
                states = pickle.load(file)  # written just now by this fit's rank 0, from the same callbacks
        finally:
            if path is not None:  # the folder goes whatever fails, Lightning's own reading included
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        # the launching process holds the same callbacks, in the same order, as the children copied
        for callback, state in zip(_carriers(trainer), states):
            callback.load_spawn_state(state)

    get_extra_results_with_states._lightning_simigrad = True  # type: ignore[attr-defined]
    launcher.get_extra_results = get_extra_results_with_states  # type: ignore[method-assign]
    launcher.update_main_process_results = update_main_process_results_with_states  # type: ignore[method-assign]

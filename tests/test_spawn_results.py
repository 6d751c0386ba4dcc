"""After a ``ddp_spawn`` fit the launching process's SimiGrad holds the fit's state, however long its history."""

from __future__ import annotations

import os
import tempfile

import pytest
from helpers import IndexedRegression, Regressor, trainer
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad, spawn_results

PIPE_BUFFER = 64 * 1024  # Linux's default: what a child may put in the launcher's result queue before it blocks


class LongHistory(SimiGrad):
    """Stands for a fit of thousands of steps: its spawn state carries a history of 20,000 rows."""

    def spawn_state(self):
        state = super().spawn_state()
        return state | {"history": state["history"] * (20_000 // len(state["history"]) + 1)}


@pytest.mark.timeout(300)
def test_a_history_larger_than_a_pipe_reaches_the_launching_process():
    cb = LongHistory(target_similarity=0.9, history_size=None)
    t = trainer(devices=2, strategy="ddp_spawn", max_epochs=1)
    t.callbacks.insert(0, cb)  # as `callbacks=[cb]` would
    # the launching process reads its result queue only after the children exit: a child putting more than the
    # pipe holds would wait forever, and so would this fit
    t.fit(Regressor(), DataLoader(IndexedRegression(64), batch_size=8, shuffle=True))
    assert len(cb.history) > 20_000 and len(repr(cb.history)) > 10 * PIPE_BUFFER
    assert cb.batch_size is not None and cb.samples_seen == 64


def test_the_states_folder_is_removed_when_lightnings_own_reading_fails():
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "spawn_states.pkl")
    open(path, "wb").close()
    launcher = object.__new__(_MultiProcessingLauncher)
    with pytest.raises(KeyError, match="callback_metrics_bytes"):  # Lightning's part of the results is missing
        _MultiProcessingLauncher.update_main_process_results(launcher, None, {spawn_results._KEY: path})
    assert not os.path.exists(folder)

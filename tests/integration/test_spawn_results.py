"""After a ``ddp_spawn`` fit the launching process's SimiGrad holds the fit's state, however long its history."""

from __future__ import annotations

import os

import pytest
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from lightning_simigrad.integration.spawn_results import Origin
from tests.support.helpers import IndexedRegression, Regressor, trainer

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
    assert not os.path.exists(cb._origin.path)  # read once, then removed


def test_a_copy_sends_and_only_the_process_that_made_the_callback_receives(tmp_path):
    here = Origin.of(object())
    elsewhere = Origin(pid=here.pid + 1, key=here.key)  # as a spawned child sees the callback it copied
    assert not here.in_copy and elsewhere.in_copy
    here.send({"state": {"steps": 3}})
    assert elsewhere.receive() is None  # a child never reads what it sent
    assert here.receive() == {"state": {"steps": 3}} and here.receive() is None  # once
    assert not os.path.exists(here.path)

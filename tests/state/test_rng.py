"""Every rank's random generator states, as the checkpoint keeps them: taken, gathered and restored."""

from __future__ import annotations

import random

import numpy
import torch

from lightning_simigrad.exchange import gather_objects
from lightning_simigrad.state.rng import RngSnapshot, rng_state, set_rng_state


def draws() -> tuple:
    return torch.rand(3).tolist(), random.random(), float(numpy.random.rand())


def test_restored_states_draw_what_the_saved_ones_drew():
    torch.manual_seed(1)
    random.seed(1)
    numpy.random.seed(1)
    state = rng_state()
    first = draws()
    draws()
    set_rng_state(state)
    assert draws() == first


def test_one_process_gathers_its_own_state_only():
    state = rng_state()
    assert gather_objects(state) == [state]
    assert set(state) >= {"torch", "python", "numpy"} and isinstance(state["torch"], bytes)


def test_a_snapshot_keeps_the_states_it_was_taken_at_while_the_generators_draw_on():
    torch.manual_seed(2)
    random.seed(2)
    numpy.random.seed(2)
    then = rng_state()
    snapshot = RngSnapshot()  # what a window's start takes; converted only if a checkpoint is written in the window
    first = draws()
    draws()
    assert snapshot.state() == then
    set_rng_state(snapshot.state())
    assert draws() == first

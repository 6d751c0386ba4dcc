"""Fixtures every test folder shares: the gloo group runner, the rendezvous port, the regression fits' step audit.

The code behind them lives in :mod:`tests.support` (importable by helpers that are not tests, and by the processes
the tests start) and, for ports, in ``benchmarks/_ports.py``, which the benchmarks use too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from benchmarks._ports import release_port, reserve_port, reserved_port
from tests.support import distributed, helpers


@pytest.fixture(autouse=True)
def master_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Every test's own ``MASTER_ADDR``/``MASTER_PORT``: a port no other socket can be handed while the test runs.

    What Lightning launches (``ddp_spawn``, ``ddp``'s subprocess launcher) and what the tests start with this
    environment (two "nodes", a recipe under FSDP) host their store there, where Lightning would otherwise pick a
    port by binding and releasing it. The environment is restored afterwards (Lightning's launchers write
    ``MASTER_PORT`` into the launching process's environment).
    """
    with reserved_port() as port:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        yield port


@pytest.fixture(name="reserve_port")
def reserve_port_fixture() -> Iterator[Callable[[], int]]:
    """More ports of the test's own (like ``master_port``), each released when the test ends."""
    ports: list[int] = []

    def reserve() -> int:
        ports.append(reserve_port())
        return ports[-1]

    yield reserve
    for port in ports:
        release_port(port)


@pytest.fixture(scope="session")
def run_group() -> Callable[..., list[distributed.Outcome]]:
    """:func:`tests.support.distributed.run_group`: ``fn`` on W gloo ranks, every rank's outcome."""
    return distributed.run_group


@pytest.fixture(scope="session")
def run_ok() -> Callable[..., list[Any]]:
    """:func:`tests.support.distributed.run_ok`: ``fn`` on W gloo ranks, every rank must return."""
    return distributed.run_ok


@pytest.fixture(scope="session")
def step_audit() -> Callable[..., Any]:
    """:func:`tests.support.helpers.step_audit`: the reference harness for a ``Regressor`` fit on a dataset."""
    return helpers.step_audit

"""Real gloo process groups on loopback for the tests, each run under a deadline so nothing can hang.

`run_group(fn, W, ...)` starts W processes that each join a fresh gloo group and call
`fn(rank, world_size, *args)`; it returns what each rank returned, or the error it raised, and its exit
code. A group still running at the deadline is killed and the test fails. The processes come from a
fork server that has imported torch and the measurement once: spawning fresh interpreters would pay
~10 s of imports per process on a 2-core machine.

The group's store is a TCPStore hosted by the launching process on a port the kernel gave it (port 0): no
port is chosen, released and bound again later (where another socket could take it first), and the store
outlives every rank, so a rank that finishes early cannot take it away from ranks still creating subgroups.
The ranks also leave together: each reports its outcome and then waits, before it destroys its process group,
until the launching process has every rank's outcome, or one rank's error (then the ranks still inside ``fn``
meet a peer that is gone, as without the wait, and fail or reach the deadline).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

START_METHOD = "forkserver"
# Python 3.11's fork server ignores the parent's sys.path, so test modules are not preloadable: the
# children import them, which is cheap after these. A fork server someone else started first still works.
# (Each child gets the parent's sys.path when it starts: `tests.*` imports there as here.)
multiprocessing.get_context(START_METHOD).set_forkserver_preload(
    ["torch", "lightning_simigrad.measurement.rank_groups"]
)
HOST = "127.0.0.1"
RELEASE = "tests.support.distributed/release"  # set by the launching process: the ranks may tear down
DUMP_AHEAD_S = 3.0  # a rank still running this long before the deadline writes its stacks (for the failure)


@dataclass
class Outcome:
    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None  # the traceback of an exception fn raised


def _child(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    wait_s: float,
    fn: Callable[..., Any],
    args: tuple,
    out,
    teardown: bool,
    stacks: str,
) -> None:
    # a rank still running near the deadline writes every thread's stack where the launching process reads it
    stack_file = open(os.path.join(stacks, f"rank{rank}.txt"), "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.dump_traceback_later(max(1.0, wait_s - DUMP_AHEAD_S), file=stack_file)
    # where the group's store is (the launching process), for anything that reads them
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = HOST, str(port)
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
    # A collective that never completes fails after this instead of hanging the child forever.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        outcome = (rank, fn(rank, world_size, *args), None)
    except BaseException:
        outcome = (rank, None, traceback.format_exc())
    out.put(outcome)
    if not teardown:  # a peer was killed: destroying the group could wait on its work towards the dead peer
        out.close()
        out.join_thread()  # the outcome is in the pipe
        os._exit(0)
    # every rank is done with the group (or one failed): leave together; the deadline ends a rank that never does
    store.wait([RELEASE], datetime.timedelta(seconds=wait_s))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_group(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    deadline_s: float = 60.0,
    pg_timeout_s: float = 40.0,
    teardown: bool = True,
    workers: bool = False,
) -> list[Outcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; every rank's outcome, in rank order.

    ``teardown=False``: each rank exits as soon as it has reported, without destroying its process group (for
    tests that kill a rank, where the survivors' teardown is not what is measured). ``workers=True``: the ranks are
    not daemonic, so their DataLoaders may start worker processes (this function still kills every rank it started).
    """
    context = multiprocessing.get_context(START_METHOD)
    out = context.Queue()
    # the store lives here, on a port bound once and kept: until every rank has ended
    timeout = datetime.timedelta(seconds=deadline_s)
    store = dist.TCPStore(HOST, 0, is_master=True, timeout=timeout, wait_for_workers=False)
    stacks = tempfile.mkdtemp(prefix="simigrad-ranks-")
    child_args = (world_size, store.port, pg_timeout_s, deadline_s, fn, args, out, teardown, stacks)
    processes = [
        context.Process(target=_child, args=(rank, *child_args), daemon=not workers) for rank in range(world_size)
    ]
    results: dict[int, tuple[Any, str | None]] = {}
    released = False

    def receive(timeout: float) -> None:
        rank, value, error = out.get(timeout=timeout)
        results[rank] = (value, error)

    try:
        for process in processes:
            process.start()
        deadline = time.monotonic() + deadline_s
        while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                receive(timeout=0.1)
            failed = any(error is not None for _, error in results.values())
            gone = any(p.exitcode is not None and rank not in results for rank, p in enumerate(processes))
            if not released and (len(results) == world_size or failed or gone):
                store.set(RELEASE, "1")
                released = True
        hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
    finally:  # also when the test is interrupted (its timeout): no rank outlives it
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
    while True:  # what arrived while the last ones exited
        try:
            receive(timeout=0.2)
        except queue.Empty:
            break
    where = "".join(_stack(stacks, rank) for rank in hung)
    shutil.rmtree(stacks, ignore_errors=True)
    if hung:
        reported = sorted(results)  # a rank that reported and still runs hung in its teardown
        pytest.fail(
            f"{fn.__name__} at W={world_size}: rank(s) {hung} still running after {deadline_s} s (hang);"
            f" rank(s) {reported} had reported{where}"
        )
    return [Outcome(rank, p.exitcode, *results.get(rank, (None, None))) for rank, p in enumerate(processes)]


def _stack(stacks: str, rank: int) -> str:
    with contextlib.suppress(OSError), open(os.path.join(stacks, f"rank{rank}.txt")) as f:
        return f"\n--- rank {rank}, {DUMP_AHEAD_S:.0f} s before the deadline:\n{f.read()}"
    return ""


def run_ok(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Like :func:`run_group`, but every rank must return: their return values, in rank order."""
    outcomes = run_group(fn, world_size, *args, **kwargs)
    for outcome in outcomes:
        if outcome.error is not None or outcome.exitcode != 0:
            pytest.fail(f"rank {outcome.rank} (exit code {outcome.exitcode}) failed:\n{outcome.error}")
    return [outcome.value for outcome in outcomes]

"""Real gloo process groups on loopback for the tests, each run under a deadline so nothing can hang.

`run_group(fn, W, ...)` starts W processes that each join a fresh gloo group and call
`fn(rank, world_size, *args)`; it returns what each rank returned, or the error it raised, and its exit
code. A group still running at the deadline is killed and the test fails. The processes come from a
fork server that has imported torch and the measurement once: spawning fresh interpreters would pay
~10 s of imports per process on a 2-core machine.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import socket
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
multiprocessing.get_context(START_METHOD).set_forkserver_preload(
    ["torch", "lightning_simigrad.measurement.rank_groups"]
)


@dataclass
class Outcome:
    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None  # the traceback of an exception fn raised


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    rank: int, world_size: int, port: int, timeout_s: float, fn: Callable[..., Any], args: tuple, out, teardown: bool
) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    # A collective that never completes fails after this instead of hanging the child forever.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        out.put((rank, fn(rank, world_size, *args), None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))
    finally:
        if not teardown:  # a peer was killed: destroying the group could wait on its work towards the dead peer
            out.close()
            out.join_thread()  # the outcome is in the pipe
            os._exit(0)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    deadline_s: float = 60.0,
    pg_timeout_s: float = 40.0,
    teardown: bool = True,
) -> list[Outcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; every rank's outcome, in rank order.

    ``teardown=False``: each rank exits as soon as it has reported, without destroying its process group (for
    tests that kill a rank, where the survivors' teardown is not what is measured).
    """
    context = multiprocessing.get_context(START_METHOD)
    out = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_child, args=(rank, world_size, port, pg_timeout_s, fn, args, out, teardown), daemon=True
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + deadline_s
    results: dict[int, tuple[Any, str | None]] = {}
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        try:
            rank, value, error = out.get(timeout=0.5)
            results[rank] = (value, error)
        except queue.Empty:
            pass
    hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(timeout=5)
    while True:  # what arrived while the last ones exited
        try:
            rank, value, error = out.get(timeout=0.2)
            results[rank] = (value, error)
        except queue.Empty:
            break
    if hung:
        reported = sorted(results)  # a rank that reported and still runs hung in its teardown
        pytest.fail(
            f"{fn.__name__} at W={world_size}: rank(s) {hung} still running after {deadline_s} s (hang);"
            f" rank(s) {reported} had reported"
        )
    return [Outcome(rank, p.exitcode, *results.get(rank, (None, None))) for rank, p in enumerate(processes)]


def run_ok(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Like :func:`run_group`, but every rank must return: their return values, in rank order."""
    outcomes = run_group(fn, world_size, *args, **kwargs)
    for outcome in outcomes:
        if outcome.error is not None or outcome.exitcode != 0:
            pytest.fail(f"rank {outcome.rank} (exit code {outcome.exitcode}) failed:\n{outcome.error}")
    return [outcome.value for outcome in outcomes]

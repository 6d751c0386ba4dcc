"""Ports for a process group's rendezvous that no other socket on this machine can be handed meanwhile.

A port found by binding port 0 and closing the socket is free only at that moment: before the process group's
store binds it, the kernel may hand it to any outgoing connection (it lies in the ephemeral range,
``/proc/sys/net/ipv4/ip_local_port_range``) and another test or benchmark process may pick it the same way. A port
from :func:`reserve_port` lies outside the ephemeral range, so the kernel never picks it by itself, and it is held
under an exclusive lock on a file of its own (``flock``) until :func:`release_port` or the end of the process
(the kernel drops the lock with the process, whatever kills it), so no other process that reserves ports here
picks it; one already bound by something else is skipped.

Used by the benchmarks (``from _ports import reserve_port``: they run as scripts beside this file) and by the tests
(``tests/support/distributed.py`` and ``tests/conftest.py``: ``from benchmarks._ports import ...``); standard
library only, so neither pulls in the other, and the library depends on neither.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

__all__ = ["reserve_port", "release_port", "reserved_port", "ephemeral_range"]

# one folder for the whole machine (not $TMPDIR, which a test may point elsewhere for its children)
LOCKS = Path("/tmp" if os.path.isdir("/tmp") else os.path.expanduser("~")) / "lightning-simigrad-ports"
WINDOW = 4096  # ports to choose from, just outside the ephemeral range
AVOID = {29400, 29500}  # torchrun's and torch's default ports, which other jobs on the machine may use unasked

_held: dict[int, int] = {}  # port -> the descriptor of its locked file, in this process


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel picks from for a socket bound to port 0 or connecting unbound (Linux's setting)."""
    try:
        low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return low, high


def _candidates() -> list[int]:
    low, high = ephemeral_range()
    below = range(max(1024, low - WINDOW), low)
    above = range(high + 1, min(65536, high + 1 + WINDOW))
    return [p for p in (below if len(below) >= len(above) else above) if p not in AVOID]


def _bindable(port: int) -> bool:
    """Nothing else listens on ``port``: bound as a process group's TCPStore binds it (every interface, IPv6 with
    IPv4 mapped where the machine has IPv6, reused)."""
    family, host = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "")
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # IPv6 compiled in but not available here
        family, host = socket.AF_INET, ""
        s = socket.socket(family, socket.SOCK_STREAM)
    with s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError:
            return False
    return True


def reserve_port() -> int:
    """A port outside the ephemeral range, held for this process until :func:`release_port` (or its end)."""
    LOCKS.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):  # other users' processes reserve ports here too
        LOCKS.chmod(0o1777)
    ports = _candidates()
    start = random.randrange(len(ports))  # processes starting together mostly try different ports first
    for port in ports[start:] + ports[:start]:
        if port in _held:
            continue
        fd = os.open(LOCKS / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process holds it
            os.close(fd)
            continue
        if not _bindable(port):  # in use by something that does not reserve its ports here
            os.close(fd)
            continue
        _held[port] = fd
        return port
    raise RuntimeError(f"no free port among {len(ports)} outside the ephemeral range {ephemeral_range()}")


def release_port(port: int) -> None:
    """Let other processes reserve ``port`` again (once nothing of this process listens on it any more)."""
    os.close(_held.pop(port))


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """:func:`reserve_port` for the duration of a ``with`` block."""
    port = reserve_port()
    try:
        yield port
    finally:
        release_port(port)

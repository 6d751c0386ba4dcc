"""A ``ddp_spawn`` (or ``ddp_fork``) fit's SimiGrad state, carried back to the process that called ``fit``.

With ``strategy="ddp_spawn"`` the fit runs in child processes, on copies of the callbacks, and Lightning sends
back only rank 0's weights and ``callback_metrics``. So a callback remembers where it was made
(:class:`Origin`: the process and the object); its copy in a child, whose process differs, writes its state
on rank 0 at the end of the fit (:func:`send`) to a file named after that origin, and the callback in the
launching process reads it the first time one of its readings is asked for afterwards (:func:`receive`).
Nothing of Lightning is patched.

The state goes through a file, not through the launcher's result queue: the launching process reads that
queue only after the children have exited, so a child putting more than the pipe's buffer (64 KiB on Linux; a
``history`` of some 600 steps) would block forever.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from dataclasses import dataclass
from typing import Any

__all__ = ["Origin"]


@dataclass(frozen=True)
class Origin:
    """The process and the object a callback was made as; copies in spawned or forked children keep it."""

    pid: int
    key: int

    @classmethod
    def of(cls, owner: object) -> Origin:
        return cls(os.getpid(), id(owner))

    @property
    def path(self) -> str:
        return os.path.join(tempfile.gettempdir(), f"lightning_simigrad-spawn-{self.pid}-{self.key}.pkl")

    @property
    def in_copy(self) -> bool:
        """This is a spawned or forked child's copy of the callback (not one made in this process)."""
        return os.getpid() != self.pid

    def send(self, state: dict[str, Any]) -> None:
        """From a child: the fit's state, for the launching process (written whole, then renamed into place)."""
        partial = f"{self.path}.{os.getpid()}"
        with open(partial, "wb") as file:
            pickle.dump(state, file)
        os.replace(partial, self.path)

    def receive(self) -> dict[str, Any] | None:
        """In the launching process: the state a child sent since the last call, or None."""
        if self.in_copy:
            return None
        try:
            with open(self.path, "rb") as file:
                return pickle.load(file)  # written by this process's own child, from the same callback
        except FileNotFoundError:
            return None
        finally:
            self.discard()

    def discard(self) -> None:
        """Forget a state no reading asked for (a fit in this process supersedes it)."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)

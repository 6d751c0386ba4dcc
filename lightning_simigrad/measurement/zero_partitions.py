r"""DeepSpeed ZeRO stages 1 and 2: the window's halves in time, on each rank's partition of the reduced gradient.

Under DeepSpeed the gradient the optimizer steps with is not in ``p.grad``: the engine reduces it into the ZeRO
optimizer, where each rank keeps its partition (ZeRO-2 reduces every micro-batch, ZeRO-1 at the accumulation
boundary), and at a boundary the partition is laid out for the step (the optimizer's ``averaged_gradients``). The
halves use exactly that:

- the engine's accumulation boundary is set before every micro-batch: the window's last, and the first half's last
  too (:attr:`ZeroPartitions.midpoint_reduction`), so that the engine reduces the
  first half's gradient :math:`s` into every rank's partition;
- right after that backward, this rank's partition of :math:`s` is copied aside and the optimizer's gradient state is
  cleared as DeepSpeed clears it for a step it skips (an fp16 overflow), and the boundary is taken back, so the
  engine's ``step()`` after that micro-batch steps nothing. The second half then accumulates :math:`r` afresh;
- after the window's last backward the partition holds :math:`r`: the products :math:`s \cdot s`, :math:`s \cdot r`,
  :math:`r \cdot r` are taken over this rank's partition, and :math:`s` is added into it, so the optimizer steps on
  :math:`s + r`, the window's gradient. The partitions are disjoint and cover the gradient, so the ranks' products
  add up to the whole gradient's (one all-gather of a row per rank, as under FSDP2).

What it costs: one partition held from the midpoint to the window's end (``1/W`` of the gradient) and, at ZeRO-1,
one more reduction a window (ZeRO-2 reduces every micro-batch anyway). The members of DeepSpeed it reads are listed,
with the versions they were read in, in :mod:`lightning_simigrad._compat` (:data:`~lightning_simigrad._compat.
DEEPSPEED_MEMBERS`); an unknown DeepSpeed is refused when the measurement attaches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from lightning_simigrad import _compat
from lightning_simigrad.core.plan import Window
from lightning_simigrad.measurement._dots import gram_and_add_all_
from lightning_simigrad.measurement.composed import Finished
from lightning_simigrad.measurement.protocol import Attachment
from lightning_simigrad.measurement.time_halves import InTime

__all__ = ["ZeroPartitions"]


class ZeroPartitions(InTime):
    """The window's halves in time on the ZeRO optimizer's gradient partitions (DeepSpeed ZeRO stages 1 and 2)."""

    name = "DeepSpeed"
    midpoint_reduction = True  # the first half's last backward is an accumulation boundary for the engine

    def __init__(self) -> None:
        self._engine: Any = None
        self._open = False  # a window started and not yet finished
        self._first: list[list[Tensor]] | None = None  # this rank's partition of the first half, per param group
        self._products: Finished | None = None
        self._read: list[Tensor] = []  # what the queued products read, kept until they are read to the host

    def attach(self, target: Attachment) -> None:
        engine = target.model
        _compat.check_deepspeed(engine)
        self._engine = engine

    def start_micro_batch(self, window: Window, index: int, params: Sequence[Tensor]) -> None:
        if index == 0:
            if self._open:
                # a window the loop abandoned (an epoch ended inside it) leaves its first half here and its partial
                # sums in the ZeRO optimizer, which would add them into this window's: both are dropped, as Lightning
                # drops such a window's gradient (after a step the engine has cleared them itself)
                self.abort()
                _compat.zero_clear_gradients(self._engine.optimizer)
            self._open = True
        # Lightning calls `engine.step()` after every micro-batch; the engine steps (and reduces, at ZeRO-1) at its
        # boundary: the window's last micro-batch, and the midpoint's, whose step `after_backward` takes back
        last = window.num_micro_batches - 1
        self._engine.set_gradient_accumulation_boundary(index in (last, window.half_split() - 1))

    def after_backward(self, window: Window, index: int, fed: tuple[int, int], params: Sequence[Tensor]) -> None:
        zero = self._engine.optimizer
        split = window.half_split()
        if index == split - 1 and index < window.num_micro_batches - 1:
            # the midpoint's backward reduced the first half into the partitions: keep this rank's, clear the rest
            self._first = [_compat.foreach_copy(list(tensors)) for tensors in _compat.zero_partitions(zero)]
            _compat.zero_clear_gradients(zero)
            self._engine.set_gradient_accumulation_boundary(False)  # the step after this micro-batch steps nothing
        elif index == window.num_micro_batches - 1 and self._first is not None:
            second = _compat.zero_partitions(zero)
            firsts, seconds = [], []
            for kept, now in zip(self._first, second, strict=True):
                if [t.shape for t in kept] != [t.shape for t in now]:
                    raise RuntimeError(
                        "DeepSpeed laid this rank's gradient partition out differently at the window's end than at its"
                        " midpoint; the halves cannot be matched"
                    )
                firsts += kept
                seconds += list(now)
            products = gram_and_add_all_(firsts, seconds)  # and s added into the partition: the step gets s + r
            self._read, self._first = firsts, None
            self._products = Finished(products, (fed[0], fed[1], window.total))

    def gradients(self, params: Sequence[Tensor]) -> list[Tensor]:
        """The gradient the optimizer steps with, as it stands after the window's last backward: this rank's
        partition (what a rescaling of the step's gradient, ``loss_items``'s, multiplies)."""
        return [t for tensors in _compat.zero_partitions(self._engine.optimizer) for t in tensors]

    def finish(self) -> Finished:
        self._open = False
        if self._first is not None:  # the optimizer would step on the second half alone: never silently
            self.abort()
            raise RuntimeError(
                "the window's last backward did not run before the optimizer step, so the first half set aside at its"
                " midpoint was never added back to DeepSpeed's gradient partition"
            )
        measured, self._products = self._products, None
        return measured if measured is not None else Finished(None, None)

    def after_read(self) -> None:
        self._read = []

    def abort(self) -> None:
        """Forget the window. A first half set aside and never joined is dropped: the window is abandoned (Lightning
        zeroes the gradient as the next one starts), so nothing of it may reach a step."""
        self._first, self._products, self._read = None, None, []

    def close(self) -> None:
        self.abort()

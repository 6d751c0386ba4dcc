r"""The measuring DDP communication hook: per gradient bucket, the collectives and the partial products.

The math and the stream story are in :mod:`lightning_simigrad.measurement.rank_groups`; this module is the
part that runs inside DDP's backward. For every bucket the hook

1. divides the bucket by :math:`W` (as DDP's reducer does, so the gradients stay bitwise DDP's);
2. *prepares*, on the hook's stream: reads or copies what the in-place all-reduce will overwrite
   (:meth:`BucketHook._prepare`);
3. issues the bucket's collectives on DDP's process group, always the same ones in the same order on
   every rank: at :math:`W \ge 4` an all-to-all within group A, then the world all-reduce;
4. *finishes* when they are done, on the measurement stream: the partial products of the bucket
   (:meth:`BucketHook._finish`), and hands DDP a future that completes after them.

A local error in step 2 or 4 never skips a collective and never fails backward: it is recorded on
the :class:`Round` and travels as NaN to :meth:`RankGroupMeasurement.collect`, where every rank
raises it together -- except an out-of-memory error, which only costs this step's measurement
(:meth:`Round.skip`): the gradients are untouched, every rank gets NaN statistics, the controller holds
and training goes on. Only a failed collective (a dead peer, a timeout) fails this rank's backward, and
only where the backend reports it (gloo; NCCL does not, see ``rank_groups``). Then every bucket future of the
round fails with it at once: after a peer dies, gloo can leave a later collective waiting for the group's
whole timeout (a message that arrives for a failed collective's freed buffer stalls that peer's connection
before its end is read), and DDP would wait on that collective's future.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_simigrad.measurement import _dots

__all__ = ["PREPARE", "FINISH", "BucketHook", "Layout", "Round"]

# Failure stages, carried as numbers through the scalar all-gather (0: none).
PREPARE = 1  # before a bucket's collectives (for a bucket after the first: between collectives)
FINISH = 2  # in a bucket's arithmetic after its collectives (the future's callback)

# Instrumentation for the checks: called on the measurement stream before each bucket's arithmetic
# (``benchmarks/gpu_check.py`` puts a ``torch.cuda._sleep`` here to widen any stream race).
callback_delay: Callable[[], None] | None = None


@dataclass(frozen=True)
class Layout:
    """Which rank does what. Group A: the first ``W // 2`` ranks; ``k`` ranks compute products."""

    world_size: int
    rank: int

    @property
    def size_a(self) -> int:
        return self.world_size // 2

    @property
    def squares(self) -> bool:
        """W = 2: every rank squares its own bucket; :math:`u \\cdot o` comes from :math:`|g|^2`."""
        return self.world_size == 2

    @property
    def exchanges(self) -> bool:
        """W >= 4: group A's ranks exchange slices of their buckets (an all-to-all)."""
        return self.size_a >= 2

    @property
    def computing(self) -> int:
        return 2 if self.squares else self.size_a

    @property
    def slot(self) -> int | None:
        """This rank's slice of every bucket, or None for a rank that computes no products."""
        return self.rank if self.rank < self.computing else None

    def bounds(self, numel: int, slot: int) -> tuple[int, int]:
        k = self.computing
        return numel * slot // k, numel * (slot + 1) // k


@dataclass
class Round:
    """One armed measurement, shared by the hook, its callbacks (other threads) and ``collect()``."""

    counts: tuple[int, ...]
    started: bool = False
    num_buckets: int = 0
    device: torch.device | None = None
    partials: dict[int, Tensor] = field(default_factory=dict)
    failure: tuple[int, BaseException] | None = None
    skipped: tuple[int, BaseException] | None = None  # out of memory: this step goes unmeasured
    void_gradient: bool = False  # a stand-in received into the bucket: the step must not be used
    broken: BaseException | None = None  # a collective failed: the group is gone, every bucket fails with this
    waiting: dict[int, torch.futures.Future[Tensor]] = field(default_factory=dict)  # bucket futures not completed
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, stage: int, error: BaseException) -> None:
        with self.lock:
            if self.failure is None:  # the first cause is the one worth reading
                self.failure = (stage, error)

    def claim(self, index: int) -> bool:
        """Whether bucket ``index``'s future is still for its own collectives to complete (not failed already)."""
        with self.lock:
            return self.waiting.pop(index, None) is not None

    def break_off(self, error: BaseException) -> list[torch.futures.Future[Tensor]]:
        """A collective failed: the futures DDP still waits on, which the caller fails with the first error."""
        with self.lock:
            if self.broken is None:
                self.broken = error
            futures, self.waiting = list(self.waiting.values()), {}
        return futures

    def fail_or_skip(self, stage: int, error: BaseException) -> None:
        """An out-of-memory error skips the measurement (the gradients are intact); anything else fails it."""
        if isinstance(error, torch.OutOfMemoryError) and not self.void_gradient:
            with self.lock:
                if self.skipped is None:
                    self.skipped = (stage, error)
        else:
            self.fail(stage, error)


@dataclass
class _Job:
    """What one bucket's preparation leaves for its collectives and its finish."""

    own: Tensor | None = None  # W = 2: this rank's local square (hook stream)
    share: Tensor | None = None  # W = 3, rank 0: a copy of its bucket (hook stream)
    send: Tensor | None = None  # W >= 4: what the all-to-all sends
    recv: Tensor | None = None  # W >= 4: where it receives group A's slices, own slice included

    def hook_stream_tensors(self) -> list[Tensor]:
        return [t for t in (self.own, self.share, self.recv) if t is not None]

    def release(self) -> None:
        self.own = self.share = self.send = self.recv = None


class BucketHook:
    """The per-bucket work of :class:`~lightning_simigrad.measurement.rank_groups.RankGroupMeasurement`."""

    def __init__(self, layout: Layout, group: dist.ProcessGroup) -> None:
        self.layout = layout
        self.group = group
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._workspaces: dict[tuple[int, str], Tensor] = {}  # CPU only: kept between windows

    def average(self, buffer: Tensor) -> torch.futures.Future[Tensor]:
        """An unmeasured bucket: DDP's own all-reduce-average, nothing else."""
        buffer.mul_(1.0 / self.layout.world_size)
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        return work.get_future().then(_first_tensor)  # type: ignore[union-attr]

    def measure(self, round: Round, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """A bucket of a measured backward: the same collectives on every rank, whatever fails here."""
        buffer, index = bucket.buffer(), bucket.index()
        if round.broken is not None:  # the group is gone: this bucket's collectives could only wait or fail
            failed: torch.futures.Future[Tensor] = torch.futures.Future()
            failed.set_exception(round.broken)  # type: ignore[arg-type]
            return failed.then(_unwrap)
        # DDP's reducer multiplies by 1/W before summing; doing the same keeps the gradients bitwise
        # equal to plain DDP (dividing after the sum would round differently at odd W).
        buffer.mul_(1.0 / self.layout.world_size)
        job: _Job | None
        try:
            job = self._prepare(buffer, index)
        except Exception as error:
            round.fail_or_skip(PREPARE, error)
            job = None
        works = []
        if self.layout.exchanges:
            if job is not None and job.send is not None and job.recv is not None:
                send, recv = job.send, job.recv
            else:
                send, recv = self._stand_ins(buffer, round)
            works.append(self._exchange(send, recv, buffer.numel()))
        works.append(dist.all_reduce(buffer, group=self.group, async_op=True))
        return self._complete(works, buffer, round, index, job)

    def clear(self) -> None:
        self._workspaces = {}

    # ------------------------------------------------------------------ the stages

    def _prepare(self, buffer: Tensor, index: int) -> _Job:
        """Before the collectives, on the hook's stream: what the in-place all-reduce would destroy."""
        layout, numel = self.layout, buffer.numel()
        if layout.squares:
            return _Job(own=_dots.square(buffer))
        slot = layout.slot
        if not layout.exchanges:  # W = 3: rank 0's bucket is all of u; B's ranks hold neither share
            share = self._workspace(index, "share", buffer, numel).copy_(buffer) if slot is not None else None
            return _Job(share=share)
        if slot is None:
            return _Job(send=buffer[:0], recv=buffer[:0])
        lo, hi = layout.bounds(numel, slot)
        recv = self._workspace(index, "recv", buffer, layout.computing * (hi - lo))
        # NCCL runs a group's collectives in issue order on one stream, so the all-to-all has read the
        # bucket before the all-reduce (issued after it) overwrites it. Gloo runs them on a thread
        # pool, possibly at once: there the all-to-all reads a copy.
        send = buffer if self._in_order(buffer) else self._workspace(index, "send", buffer, numel).copy_(buffer)
        return _Job(send=send, recv=recv)

    def _finish(self, job: _Job, buffer: Tensor) -> Tensor | None:
        """After the collectives, on the measurement stream: ``[u.u, u.g, g.g, o.o]`` over this rank's slice."""
        layout = self.layout
        slot = layout.slot
        if slot is None:
            return None
        lo, hi = layout.bounds(buffer.numel(), slot)
        parts = torch.zeros(4, dtype=torch.float64, device=buffer.device)
        if layout.squares:
            assert job.own is not None
            parts[2] = _dots.square(buffer[lo:hi])
            parts[3 if slot == 1 else 0] = job.own
        elif job.share is not None:
            parts[:3] = _dots.gram(job.share, buffer)
        else:
            assert job.recv is not None
            width = hi - lo
            # the slices arrived in rank order; u is their sum, taken in float32 or wider chunk by chunk
            slices = job.recv[: layout.computing * width].view(layout.computing, width)
            parts[:3] = _dots.gram_of_sum(slices, buffer[lo:hi])
        return parts

    # ------------------------------------------------------------------ collectives and streams

    def _exchange(self, send: Tensor, recv: Tensor, numel: int) -> Any:
        """Group A's reduce-scatter of slices, as an all-to-all over DDP's own group (one communicator)."""
        layout, k = self.layout, self.layout.computing
        slot = layout.slot
        pad = [0] * (layout.world_size - k)
        if slot is None:
            in_sizes, out_sizes = [0] * layout.world_size, [0] * layout.world_size
        else:
            in_sizes = [hi - lo for lo, hi in (layout.bounds(numel, j) for j in range(k))] + pad
            lo, hi = layout.bounds(numel, slot)
            out_sizes = [hi - lo] * k + pad
        return dist.all_to_all_single(recv, send, out_sizes, in_sizes, group=self.group, async_op=True)

    def _stand_ins(self, buffer: Tensor, round: Round) -> tuple[Tensor, Tensor]:
        """Tensors of the agreed sizes for the all-to-all of a bucket whose preparation failed.

        The rank still takes part, so that no other rank waits on it; what it sends and receives is void.
        It receives into a fresh tensor when one can be had, so the bucket (and this step's gradient) is
        untouched and the step goes on unmeasured; failing that, the bucket itself stands in, so that a
        failure to allocate cannot stop the collective, and the step's gradient is void: every rank then
        raises before the optimizer uses it.
        """
        slot = self.layout.slot
        if slot is None:
            return buffer[:0], buffer[:0]
        lo, hi = self.layout.bounds(buffer.numel(), slot)
        need = self.layout.computing * (hi - lo)
        try:
            recv = torch.empty(need, dtype=buffer.dtype, device=buffer.device)
        except torch.OutOfMemoryError as error:
            round.void_gradient = True
            round.fail(PREPARE, error)
            recv = buffer[:need]
        return buffer, recv

    def _complete(
        self, works: list[Any], buffer: Tensor, round: Round, index: int, job: _Job | None
    ) -> torch.futures.Future[Tensor]:
        """The future DDP waits on: done when the collectives and this bucket's arithmetic are.

        The collectives' callbacks may run on whatever stream is current (the hook's, under NCCL, where
        futures complete at issue): the last one therefore switches to the measurement stream itself before
        waiting on the collectives, and sets the result there, so that DDP's wait orders the gradient after
        the arithmetic that reads the bucket. A failed collective fails the round's futures at once (above).

        Under NCCL it also waits on the collectives' ``Work`` objects: NCCL keeps a collective's tensors
        stashed (instead of ``record_stream``) until its watchdog sees it end, and ``Work.wait()`` orders the
        current stream after the collective and lets go of the stash, so a receive buffer is freed once its
        products are taken, not when the watchdog next looks (read in torch's sources, not yet run on a GPU).
        Under gloo, waiting on a ``Work`` from inside a future's callback deadlocks; the future suffices there.
        """
        cuda = buffer.is_cuda
        result: torch.futures.Future[Tensor] = (
            torch.futures.Future(devices=[buffer.device]) if cuda else torch.futures.Future()
        )
        stream = self._stream(buffer.device) if cuda else None

        def done() -> None:
            try:
                with _current(stream):
                    for future in futures:
                        future.wait()  # on CUDA: this stream waits for the collective
                    if nccl:
                        for work in works:  # lets go of NCCL's stash (see above); the stream order is the same
                            work.wait()
                    if job is not None:
                        self._finish_into(round, index, job, buffer, stream)
                        job.release()  # the products are taken: the copies and receive buffers can go
                    if round.claim(index):  # on this stream: DDP's wait orders the gradient after the products
                        result.set_result(buffer)
            except Exception as error:
                fail(error)

        def fail(error: BaseException) -> None:
            """A collective failed: that must fail backward, on every rank, and at once."""
            wrapped = RuntimeError(
                f"A collective of SimiGrad's DDP measurement failed ({type(error).__name__}: {error}). A rank "
                "died or the process group timed out; see the first failing rank's log."
            )
            wrapped.__cause__ = error
            for future in round.break_off(wrapped):  # this bucket's among them, unless an earlier failure took it
                future.set_exception(wrapped)  # type: ignore[arg-type]

        def arrived(future: torch.futures.Future[Any]) -> None:
            try:
                future.value()  # re-raises a failed collective (gloo); synchronises nothing
            except Exception as error:
                fail(error)  # now, not once the bucket's other collective ends: that one may never
                return
            with round.lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                done()

        futures = [work.get_future() for work in works]
        left = [len(futures)]
        nccl = self._in_order(buffer)
        with round.lock:
            round.waiting[index] = result
        for future in futures:
            future.add_done_callback(arrived)
        return result.then(_unwrap)

    def _finish_into(self, round: Round, index: int, job: _Job, buffer: Tensor, stream: Any) -> None:
        try:
            if stream is not None:
                # Made on the hook's stream, read on this one: the allocator must not hand their blocks
                # to the hook's stream before this stream has read them.
                for tensor in job.hook_stream_tensors():
                    tensor.record_stream(stream)
            if callback_delay is not None:
                callback_delay()
            partial = self._finish(job, buffer)
            if partial is not None:
                with round.lock:
                    round.partials[index] = partial
        except Exception as error:
            round.fail_or_skip(FINISH, error)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            # High priority: the default priority draws from the pool of 32 streams that NCCL's internal
            # stream and Lightning's side stream come from too, and sharing one of them serialises with it.
            stream = self._streams[device] = torch.cuda.Stream(device=device, priority=-1)
        return stream

    def measurement_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        return self._streams.get(device)

    def _in_order(self, buffer: Tensor) -> bool:
        return buffer.is_cuda and "nccl" in str(dist.get_backend(self.group)).lower()

    def _workspace(self, index: int, role: str, like: Tensor, numel: int) -> Tensor:
        """A 1-D tensor like ``like``: kept per (bucket, role) on CPU, where fresh pages cost more than
        the copy; fresh on accelerators, whose caching allocator reuses blocks already."""
        if like.device.type != "cpu":
            return torch.empty(numel, dtype=like.dtype, device=like.device)
        key = (index, role)
        cached = self._workspaces.get(key)
        if cached is None or cached.numel() != numel or cached.dtype != like.dtype:
            cached = self._workspaces[key] = torch.empty(numel, dtype=like.dtype)
        return cached


@contextlib.contextmanager
def _current(stream: torch.cuda.Stream | None) -> Iterator[None]:
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


def _first_tensor(fut: torch.futures.Future[list[Tensor]]) -> Tensor:
    return fut.value()[0]


def _unwrap(fut: torch.futures.Future[Tensor]) -> Tensor:
    # wait() raises an exception set on the future inside torch's own error path, so the reducer
    # re-raises it with its message (a bare set_exception future surfaces as "Unable to cast").
    return fut.wait()

r"""Measuring the two half-batch gradients under DDP, inside the communication hook.

The ranks of the data-parallel group (size :math:`W \ge 2`) are split into two static groups:

* group A: the first :math:`\lfloor W/2 \rfloor` ranks (rank 0 is always in A),
* group B: the remaining :math:`\lceil W/2 \rceil` ranks.

So at ``W = 2`` A = {0}, at ``W = 3`` A = {0} and B = {1, 2} (unequal groups are fine: the halves
are weighted by their sample counts), at ``W = 4`` A = {0, 1}.

The math
--------
In a window, rank :math:`r` sees :math:`n_r` samples, :math:`N = \sum_r n_r`. The caller pre-weights
the loss so that the rank's accumulated local gradient is :math:`h_r = (W/N) \sum_{i \in r} \nabla_i`;
DDP's all-reduce-then-divide-by-W then yields the exact global mean :math:`g = (1/N) \sum_i \nabla_i`.
Write :math:`u = \frac1W \sum_{r \in A} h_r` (group A's share of :math:`g`) and :math:`o = g - u`
(group B's share). The half-batch mean gradients are

.. math::

    g_A = \frac{N}{n_A} u, \qquad g_B = \frac{N}{n_B} o = \frac{N g - n_A g_A}{n_B},

so :math:`|g_A|^2`, :math:`|g_B|^2` and :math:`g_A \cdot g_B` follow from the three dot products
:math:`u \cdot u`, :math:`u \cdot o`, :math:`o \cdot o`. They are sums over DDP's buckets, so each
bucket contributes a partial sum as soon as its all-reduce is done, accumulated in float64 whatever
the gradient dtype.

Why it is cheap
---------------
Write :math:`b_r = h_r/W` for rank :math:`r`'s pre-divided bucket (what it contributes to :math:`g`).
Every rank computes something, on a slice of each bucket where it can, and the products are carried
by the all-gather of :meth:`RankGroupMeasurement.collect`, which happens anyway:

* ``W = 2``: no copy, no extra traffic. Before launching the all-reduce each rank computes the local
  square of its own bucket (:math:`u \cdot u = |b_0|^2` on rank 0, :math:`o \cdot o = |b_1|^2` on
  rank 1; it only reads the bucket). After the all-reduce each computes :math:`|g|^2` over half of
  the bucket. Then :math:`u \cdot o = (|g|^2 - u \cdot u - o \cdot o)/2`; each term is accumulated in
  float64 from float32 chunk products, so the difference keeps float32 accuracy relative to
  :math:`|u|\,|o|` even at similarity 0 (the error is a few ulps of :math:`|u|^2 + |o|^2`).
* ``W = 3``: group A is rank 0 alone, :math:`u = b_0`; rank 0 copies its bucket before the
  all-reduce and computes :math:`[u \cdot u, u \cdot g, g \cdot g]` over the whole of it. No extra
  traffic. (A clone-free variant would need the cross product :math:`b_1 \cdot b_2` of group B, that
  is, an exchange between ranks 1 and 2: more than the copy costs.)
* ``W >= 4``: group A's ranks (:math:`k = \lfloor W/2 \rfloor`) copy their bucket and reduce-scatter
  the copy within group A (an ``all_to_all`` of slices, summed locally: gloo's reduce-scatter has no
  future), beside DDP's world all-reduce, so each of them ends with its slice of :math:`u` and
  computes the products on that slice. That is half the bytes of a half-group all-reduce, once per
  measured window; group B's ranks do nothing extra.

On CPU the copies go into buffers kept for the next measured window (fresh allocations of this size
are returned to the OS and page-faulted in again, which cost more than the copy); on accelerators the
caching allocator already reuses memory. :meth:`RankGroupMeasurement.collect` then all-gathers five
float64 scalars per rank, and every rank sums them in rank order, so every rank gets bitwise the same
:class:`~lightning_simigrad.statistics.HalfStats` (and so takes the same batch-size decision). The
gradients DDP writes are those of its world all-reduce, computed exactly as its built-in reducer does
(multiply by :math:`1/W`, then sum), so they equal plain DDP's.

Communication per measured window, besides DDP's own world all-reduce of the gradient (:math:`P`
elements):

========  ===========================================  ==============================
W         extra gradient traffic                       extra scalars (``collect``)
========  ===========================================  ==============================
2         none                                         all-gather of 5 float64 / rank
3         none                                         all-gather of 5 float64 / rank
>= 4      reduce-scatter of :math:`P` within group A   all-gather of 5 float64 / rank
========  ===========================================  ==============================

Unarmed synchronisations (windows that are not measured) do the plain all-reduce-average.
"""

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_simigrad._dots import gram, square
from lightning_simigrad.statistics import HalfStats

__all__ = ["RankGroupMeasurement"]


def _bucket_dots(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``[u.u, u.g, g.g]`` as a float64 tensor of shape (3,) (one pass over both)."""
    return gram(u, g)


def _registered_hook_name(ddp_model: DistributedDataParallel) -> str | None:
    """The name of a communication hook already on ``ddp_model``, or None.

    ``register_comm_hook`` appends to ``ddp_model._comm_hooks``; the built-in (C++) hooks of
    ``_register_builtin_comm_hook`` leave that list empty but record their name in DDP's logging data.
    Both are private, so each is read defensively; :meth:`RankGroupMeasurement.register` also catches
    the reducer's own "can only be called once" error as a last line.
    """
    hooks = getattr(ddp_model, "_comm_hooks", None)
    if hooks:
        hook = hooks[0][0]
        return str(getattr(hook, "__qualname__", hook))
    try:
        name = ddp_model._get_ddp_logging_data().get("comm_hook")
    except Exception:  # private API: its absence must not block registration
        name = None
    return str(name) if name else None


class RankGroupMeasurement:
    """Half-batch gradient statistics of DDP's synchronising backward, measured in a comm hook.

    Construct it on every rank, in the same order relative to other process-group creations (it may
    create group A's subgroup with ``dist.new_group``, which all ranks of the default group must
    enter). Then per measured window:

    1. ``arm(samples_per_rank)`` on every rank before the synchronising (last) backward of the window;
    2. run the backward (DDP's gradients come out exactly as without the hook);
    3. ``collect()`` on every rank: a collective returning the same :class:`HalfStats` everywhere.

    Args:
        process_group: the group DDP synchronises over; None for the default (world) group.

    Raises:
        RuntimeError: if ``torch.distributed`` is not initialised or this rank is not in the group.
        ValueError: if the group has fewer than two ranks (there would be no two halves).

    Example::

        measurement = RankGroupMeasurement()
        measurement.register(ddp_model)
        ...
        measurement.arm(samples_per_rank)  # before the backward that synchronises
        loss.backward()
        stats = measurement.collect()  # HalfStats, identical on all ranks
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "RankGroupMeasurement needs an initialised process group: call "
                "`torch.distributed.init_process_group(...)` first."
            )
        self._pg = process_group if process_group is not None else dist.group.WORLD
        self._world_size = dist.get_world_size(self._pg)
        if self._world_size < 2:
            raise ValueError(
                f"RankGroupMeasurement needs a process group of at least 2 ranks, got {self._world_size}. "
                "On one process measure the two halves of the accumulation window instead."
            )
        self._rank = dist.get_rank(self._pg)
        if self._rank < 0:
            raise RuntimeError("This rank is not a member of `process_group`.")
        self._global_ranks = dist.get_process_group_ranks(self._pg)
        self._size_a = self._world_size // 2
        # Which ranks compute the dot products, and which slice of every bucket this rank takes.
        if self._size_a >= 2:
            computing = self._size_a  # group A's ranks, after the reduce-scatter within group A
        elif self._world_size == 2:
            computing = 2  # rank 0 holds u, rank 1 holds o: local squares, then |g|^2 on a slice each
        else:
            computing = 1  # W = 3: rank 0 alone holds u; B's ranks hold neither share
        self._num_computing = computing
        self._slot: int | None = self._rank if self._rank < computing else None
        self._squares = self._world_size == 2  # u.o from |g|^2 - u.u - o.o (see the module docstring)
        # CPU only: copy targets kept between measured windows, per bucket index (see the docstring).
        self._workspaces: dict[int, torch.Tensor] = {}
        # Group A needs its own group only when it has >= 2 ranks. Its all-reduce runs beside DDP's
        # world all-reduce from the same thread, in bucket order: one group per phase, never one shared
        # (the notes saw a shared group deadlock at random).
        self._half_group: dist.ProcessGroup | None = None
        if self._size_a >= 2:
            group = dist.new_group(ranks=self._global_ranks[: self._size_a], backend=dist.get_backend(self._pg))
            if self.group_of(self._rank) == 0:
                self._half_group = group  # type: ignore[assignment]
        self._lock = threading.Lock()
        self._model: DistributedDataParallel | None = None
        self._closed = False
        # Per-measurement state, written by `arm()` (main thread), the hook (autograd thread) and the
        # bucket callbacks (comm threads; those only touch `_partials`, under the lock).
        self._state = "idle"  # idle -> armed -> measuring (buckets flowing) -> measured -> idle
        self._counts: tuple[int, ...] = ()
        self._partials: dict[int, torch.Tensor] = {}
        self._num_buckets = 0
        self._device = torch.device("cpu")

    # ------------------------------------------------------------------ public API

    @property
    def world_size(self) -> int:
        return self._world_size

    def group_of(self, rank: int) -> int:
        """0 if ``rank`` (a rank of the process group) is in group A (the first ``W // 2``), else 1."""
        if not 0 <= rank < self._world_size:
            raise ValueError(f"`rank` must lie in [0, {self._world_size}), got {rank}.")
        return 0 if rank < self._size_a else 1

    def register(self, ddp_model: DistributedDataParallel) -> None:
        """Register the measuring comm hook on ``ddp_model`` (the DDP wrapper itself).

        Raises:
            TypeError: if ``ddp_model`` is not a ``DistributedDataParallel``.
            RuntimeError: if the model already has a communication hook (torch allows one), or this
                measurement is closed or already registered.
            ValueError: if the model synchronises over a different process group.
        """
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(
                f"`ddp_model` must be a torch DistributedDataParallel, got {type(ddp_model).__name__}. "
                "In Lightning pass `trainer.strategy.model`."
            )
        if self._closed:
            raise RuntimeError("This RankGroupMeasurement is closed; create a new one.")
        if self._model is not None:
            raise RuntimeError("This RankGroupMeasurement is already registered on a model.")
        if dist.get_process_group_ranks(ddp_model.process_group) != self._global_ranks:
            raise ValueError(
                "`ddp_model` synchronises over a different process group than this measurement's; "
                "pass the DDP model's group as `process_group`."
            )
        existing = _registered_hook_name(ddp_model)
        if existing is not None:
            raise RuntimeError(self._hook_conflict_message(existing))
        try:
            ddp_model.register_comm_hook(state=None, hook=self._make_hook())
        except RuntimeError as error:
            if "can only be called once" not in str(error):
                raise
            ddp_model._comm_hooks.pop()  # DDP appended ours before the reducer refused it
            raise RuntimeError(self._hook_conflict_message("unknown")) from error
        self._model = ddp_model

    def arm(self, samples_per_rank: Sequence[int]) -> None:
        """Measure the next synchronising backward; ``samples_per_rank[r]`` is rank r's :math:`n_r`.

        Call it on every rank with the same list. The window's losses must be weighted so that each
        rank's accumulated gradient is :math:`(W/N) \\sum_i \\nabla_i` (see the module docstring).

        Raises:
            ValueError: for a list of the wrong length, negative counts, or a group without samples.
            RuntimeError: if the previous measurement was not collected, or this object is closed.
        """
        if self._closed:
            raise RuntimeError("This RankGroupMeasurement is closed; create a new one.")
        if self._model is None:
            raise RuntimeError("Call `register(ddp_model)` before `arm()`.")
        counts = tuple(int(n) for n in samples_per_rank)
        if len(counts) != self._world_size:
            raise ValueError(
                f"`samples_per_rank` must hold one count per rank ({self._world_size}), got {len(counts)}."
            )
        if any(n < 0 for n in counts):
            raise ValueError(f"`samples_per_rank` must be non-negative, got {list(counts)}.")
        n_a, n_b = sum(counts[: self._size_a]), sum(counts[self._size_a :])
        if n_a == 0 or n_b == 0:
            raise ValueError(
                f"Both rank groups need samples in a measured window (group A = ranks "
                f"0..{self._size_a - 1}), got n_A={n_a}, n_B={n_b} from {list(counts)}."
            )
        if self._state in ("measuring", "measured"):
            raise RuntimeError(
                "The previous measurement has not been collected: call `collect()` on every rank after "
                "the synchronising backward (or `disarm()` to drop it) before arming again."
            )
        self._counts = counts
        self._state = "armed"

    def disarm(self) -> None:
        """Drop an armed or uncollected measurement (local, no communication). Call it on all ranks."""
        self._reset()

    def collect(self) -> HalfStats | None:
        """The statistics of the last armed synchronisation, bitwise identical on every rank.

        A collective (an all-gather of five float64 scalars per rank): call it on every rank after the
        synchronising backward returned. Returns None when nothing was armed, and disarms.

        Raises:
            RuntimeError: if armed but no synchronising backward completed since ``arm()``.
        """
        state, counts = self._state, self._counts
        if state == "idle":
            return None
        if state != "measured":
            self._reset()
            raise RuntimeError(
                "`collect()` was called after `arm()` but before a synchronising backward completed: "
                "arm before the window's last backward (the one outside `no_sync()`) and collect after it."
            )
        n_a, n_b = sum(counts[: self._size_a]), sum(counts[self._size_a :])
        # This rank's parts of [u.u, u.g, g.g, o.o] (see `_hook`), and how many buckets it is missing.
        local = [0.0, 0.0, 0.0, 0.0, 0.0]
        if self._slot is not None:
            with self._lock:
                partials = [self._partials.get(i) for i in range(self._num_buckets)]
            present = [p for p in partials if p is not None]
            if present:
                local[:4] = torch.stack(present).sum(dim=0).tolist()
            local[4] = float(len(partials) - len(present))
        device = self._device
        self._reset()
        mine = torch.tensor(local, dtype=torch.float64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self._world_size)]
        dist.all_gather(gathered, mine, group=self._pg)
        # Identical inputs, identical order of float additions: bitwise the same result on every rank.
        uu = ug = gg = oo = missing = 0.0
        for row in gathered:
            r_uu, r_ug, r_gg, r_oo, r_missing = row.tolist()
            uu, ug, gg, oo, missing = uu + r_uu, ug + r_ug, gg + r_gg, oo + r_oo, missing + r_missing
        if missing:
            raise RuntimeError(
                f"{int(missing)} bucket result(s) of the synchronising backward never arrived; the "
                "measurement is lost. Was the backward interrupted?"
            )
        if self._squares:  # W = 2: |g|^2 = u.u + 2 u.o + o.o, each square measured directly
            uo = 0.5 * (gg - uu - oo)
        else:  # from u.g: u.o = u.g - u.u, o.o = g.g - 2 u.g + u.u
            uo, oo = ug - uu, gg - 2.0 * ug + uu
        n = n_a + n_b
        c_a, c_b = n / n_a, n / n_b  # g_A = c_a u, g_B = c_b o
        dot, sq_a, sq_b = c_a * c_b * uo, c_a * c_a * uu, c_b * c_b * oo
        return HalfStats(dot=dot, sq_a=sq_a, sq_b=sq_b, n_a=n_a, n_b=n_b)

    def close(self) -> None:
        """Destroy the subgroup this object created; the hook then only averages. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._reset()
        self._workspaces = {}
        if self._half_group is not None:
            dist.destroy_process_group(self._half_group)
            self._half_group = None

    # ------------------------------------------------------------------ internals

    def _reset(self) -> None:
        self._state = "idle"
        self._counts = ()
        self._partials = {}
        self._num_buckets = 0
        self._device = torch.device("cpu")

    @staticmethod
    def _hook_conflict_message(existing: str) -> str:
        return (
            f"The DistributedDataParallel model already has a communication hook ({existing}) and torch "
            "allows one per model. SimiGrad measures inside its own hook, which averages exactly like "
            "DDP's default all-reduce: remove the other hook (e.g. `DDPStrategy(ddp_comm_hook=...)`, "
            "DDP `mixed_precision`), or do not use SimiGrad's DDP measurement with it."
        )

    def _make_hook(self) -> Callable[[object, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
        def simigrad_measurement_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            return self._hook(bucket)

        return simigrad_measurement_hook

    def _hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        index = bucket.index()
        if index == 0 and self._state == "armed" and not self._closed:
            self._state = "measuring"
            self._device = buffer.device
        measuring = self._state == "measuring"
        # DDP's built-in reducer multiplies by 1/W before summing; doing the same keeps the gradients
        # bitwise equal to plain DDP (dividing after the sum would round differently at odd W).
        buffer.mul_(1.0 / self._world_size)
        if measuring and bucket.is_last():
            self._num_buckets, self._state = index + 1, "measured"
        slot = self._slot
        if not measuring or slot is None:
            world = dist.all_reduce(buffer, group=self._pg, async_op=True).get_future()  # type: ignore[union-attr]
            return _then(world, lambda _: buffer, buffer.device)
        numel, k = buffer.numel(), self._num_computing
        lo, hi = numel * slot // k, numel * (slot + 1) // k
        zero = torch.zeros((), dtype=torch.float64, device=buffer.device)
        if self._squares:
            # W = 2: the local square of this rank's share, read before the in-place all-reduce
            # overwrites it. An error here must still let the all-reduce run (the partner waits on it)
            # and then reach backward through the future.
            own: torch.Tensor | BaseException
            try:
                own = square(buffer)
            except BaseException as error:
                own = error
            world = dist.all_reduce(buffer, group=self._pg, async_op=True).get_future()  # type: ignore[union-attr]
            holds_b = slot == 1

            def finish_squares(_: Any) -> torch.Tensor:
                if isinstance(own, BaseException):
                    raise own
                gg = square(buffer[lo:hi])
                parts = torch.stack([zero, zero, gg, own] if holds_b else [own, zero, gg, zero])
                with self._lock:
                    self._partials[index] = parts
                return buffer

            return _then(world, finish_squares, buffer.device)

        # This rank's (pre-divided) bucket, copied before the in-place world all-reduce overwrites it.
        share = self._workspace(index, 0, buffer, numel).copy_(buffer)
        futures = [dist.all_reduce(buffer, group=self._pg, async_op=True).get_future()]  # type: ignore[union-attr]
        if self._half_group is not None:
            # Reduce-scatter within group A as an all-to-all of slices (gloo's reduce_scatter has no
            # future): A-rank j receives the other A-ranks' slice j and adds them to its own below.
            # Its own slice is not sent to itself (split size 0) where the others' slices are contiguous
            # (the first and last A-rank: all of them at k = 2), so nothing is copied twice.
            mine = hi - lo
            skip_self = slot in (0, k - 1)
            sizes_in = [numel * (j + 1) // k - numel * j // k for j in range(k)]
            sizes_out = [mine] * k
            if skip_self:
                sizes_in[slot] = sizes_out[slot] = 0
            send = (share[hi:] if slot == 0 else share[:lo]) if skip_self else share
            received = self._workspace(index, 1, buffer, sum(sizes_out))
            work = dist.all_to_all_single(  # issued right after the world all-reduce, in bucket order
                received, send, sizes_out, sizes_in, group=self._half_group, async_op=True
            )
            futures.append(work.get_future())  # type: ignore[union-attr]
            others = [received[j * mine : (j + 1) * mine] for j in range(k) if sizes_out[j] and j != slot]
            if skip_self:  # the pieces are packed: the zero-size own slot takes no room
                others = list(received.split(mine)) if mine else []
        else:  # W = 3: rank 0's bucket is all of u
            others = []

        def finish(_: Any) -> torch.Tensor:
            u = share[lo:hi]
            for piece in others:  # the all-to-all has read `share`: summing into it is safe
                u.add_(piece)
            if u.is_cuda:  # allocated on the autograd stream, read on this callback's stream
                u.record_stream(torch.cuda.current_stream(u.device))
            parts = torch.cat([_bucket_dots(u, buffer[lo:hi]), zero.view(1)])
            with self._lock:
                self._partials[index] = parts
            return buffer

        return _then(torch.futures.collect_all(futures), finish, buffer.device)

    def _workspace(self, index: int, role: int, like: torch.Tensor, numel: int) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements like ``like``: kept per (bucket, role) on CPU, else fresh."""
        if like.device.type != "cpu":
            return torch.empty(numel, dtype=like.dtype, device=like.device)
        key = 2 * index + role
        cached = self._workspaces.get(key)
        if cached is None or cached.numel() != numel or cached.dtype != like.dtype:
            cached = self._workspaces[key] = torch.empty(numel, dtype=like.dtype)
        return cached


def _then(
    fut: torch.futures.Future[Any], fn: Callable[[Any], torch.Tensor], device: torch.device
) -> torch.futures.Future[torch.Tensor]:
    """Like ``fut.then(fn)``, but any exception (of a collective or of ``fn``) is raised by backward.

    Errors inside future callbacks are easy to lose (the notes saw one hang DDP's backward silently),
    so every error is caught here and ``set_exception`` on the future handed to DDP. The final
    ``.then(_unwrap)`` turns that into a C++-side error, which the reducer re-raises with the original
    message (a bare ``set_exception`` future would surface as "Unable to cast ... to Tensor").
    For CUDA tensors the future is told its device, so ``set_result`` records the callback's stream
    and the reducer's wait orders the gradient copy after it.
    """
    result: torch.futures.Future[torch.Tensor] = (
        torch.futures.Future() if device.type == "cpu" else torch.futures.Future(devices=[device])
    )

    def done(parent: torch.futures.Future[Any]) -> None:
        try:
            # wait(), not value(): it re-raises a failed collective and, for CUDA futures, makes the
            # current stream wait for the collective's kernels (collect_all's own future carries none).
            value = parent.wait()
            for sub in value if isinstance(value, list) else ():
                if isinstance(sub, torch.futures.Future):
                    sub.wait()
            result.set_result(fn(value))
        except BaseException as error:  # whatever it is, it must reach the reducer
            wrapped = RuntimeError(f"lightning_simigrad's DDP measurement hook failed: {type(error).__name__}: {error}")
            wrapped.__cause__ = error
            result.set_exception(wrapped)  # type: ignore[arg-type]

    fut.add_done_callback(done)
    return result.then(_unwrap)


def _unwrap(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return fut.wait()  # raises the exception set above, inside torch's own error path

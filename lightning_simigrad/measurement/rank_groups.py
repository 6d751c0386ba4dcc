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
bucket contributes a partial sum as soon as its collectives are done, accumulated in float64.

Why it is cheap
---------------
Write :math:`b_r = h_r/W` for rank :math:`r`'s pre-divided bucket (what it contributes to :math:`g`):

* ``W = 2``: no copy, no extra traffic. Before the all-reduce each rank squares its own bucket
  (:math:`u \cdot u = |b_0|^2` on rank 0, :math:`o \cdot o = |b_1|^2` on rank 1); after it, each
  squares :math:`g` over half of the bucket. Then :math:`u \cdot o = (|g|^2 - u \cdot u - o \cdot o)/2`,
  accurate to a few ulps of :math:`|u|^2 + |o|^2` even at similarity 0.
* ``W = 3``: rank 0 (all of group A) copies its bucket before the all-reduce and takes
  :math:`[u \cdot u, u \cdot g, g \cdot g]` over all of it. No extra traffic.
* ``W >= 4``: group A's :math:`k = \lfloor W/2 \rfloor` ranks exchange slices of their buckets (an
  all-to-all within A, over DDP's own process group, before the world all-reduce), so each ends with its
  slice of :math:`u` and takes the products there: half the bytes of a half-group all-reduce, once
  per measured window. Group B's ranks take part with empty slices and compute nothing.

:meth:`RankGroupMeasurement.collect` then all-gathers a row of six float64 numbers per rank
(:mod:`~lightning_simigrad.measurement.rows`), and every rank sums them in rank order, so every rank gets bitwise
the same :class:`~lightning_simigrad.core.statistics.HalfStats` and takes the same batch-size decision. The
gradients are those of DDP's world all-reduce, computed exactly as its built-in reducer does (multiply by
:math:`1/W`, then sum).

========  =============================================  ==============================
W         extra gradient traffic per measured window      extra scalars (``collect``)
========  =============================================  ==============================
2         none                                            all-gather of 6 float64 / rank
3         none                                            all-gather of 6 float64 / rank
>= 4      all-to-all of :math:`P` within group A           all-gather of 6 float64 / rank
========  =============================================  ==============================

Unarmed synchronisations (windows that are not measured) do the plain all-reduce-average.

Streams (CUDA)
--------------
Every tensor has one stream that makes it and the streams that read it are ordered after it; a tensor
read on another stream is marked with ``record_stream`` before it can be freed.

* **hook stream** (the stream current in the hook: the backward's): the pre-division, the local square
  (W = 2) or the bucket copy (W = 3), the receive buffer (W >= 4). The collectives are issued from here,
  so NCCL's stream waits for them.
* **NCCL stream** (the process group's, one per device): the all-to-all, then the all-reduce, of each
  bucket in issue order (one communicator only, so no two communicators ever compete for the GPU).
* **measurement stream** (one per device, owned by this object, high priority so that it is none of the
  pooled streams NCCL and Lightning use): each bucket's products. It waits on the
  bucket's collectives (their futures' events); the hook stream's tensors it reads are
  ``record_stream``-ed to it. The future handed to DDP is completed on it, so DDP's copy of the gradient
  waits for the products that read the bucket -- and the backward itself never waits for a collective.
* **collect's stream** (the current stream of ``collect()``): waits for the measurement stream, sums
  the bucket products (``record_stream``-ed to it), all-gathers the rows (NCCL waits for it) and reads
  them, with the GradScaler's scale, to the host in one transfer: the measurement's one host
  synchronisation per optimizer step. The hook and its callbacks never synchronise with the host.

Failures
--------
Every rank issues the same collectives in the same order whatever fails locally. An error while preparing
a bucket, in a bucket's arithmetic, or in ``collect()`` before its all-gather is recorded, the rank's
products become NaN, and the failure travels in the all-gathered rows: every rank then raises the same
:class:`MeasurementError` from ``collect()``, before the optimizer steps (the failing rank chains the
original error). An out-of-memory error there only skips the step's measurement: the rank's row says so,
every rank returns NaN statistics (the controller holds), rank 0 warns (:class:`MeasurementSkipped`) and the
gradients, untouched, are used. A bucket whose preparation failed still takes part in the all-to-all, with a
fresh receive buffer (or, if even that cannot be had, the bucket itself: then the step's gradient is void and
every rank raises).

A collective that fails is reported by gloo (a dead peer: within seconds) through the future, and fails the
backward of every rank that waits on it. NCCL completes a collective's future at issue and reports nothing
there: a dead or failing peer leaves the survivors blocked at their next host read (``collect()``'s) until the
process group's timeout, when NCCL's watchdog ends the process. Set ``timeout=`` on the process group
(Lightning: ``DDPStrategy(timeout=...)``) and let the launcher restart from the last checkpoint.

Memory
------
Extra memory per bucket of :math:`P_b` elements, from the hook until that bucket's products are taken:

* ``W = 2``: none beyond the chunk scratch below.
* ``W = 3``: rank 0 one copy of its bucket; ranks 1 and 2 nothing.
* ``W >= 4``: each rank of group A one receive buffer of :math:`k \lceil P_b/k \rceil` elements (about one
  bucket), plus, under gloo, a copy of the bucket to send; group B's ranks nothing.

So at most one gradient's worth (two under gloo at ``W >= 4``) on group A's ranks, reached only if every
bucket is in flight at once; on CPU these buffers are kept between windows (fresh pages cost more than the
copies). A bucket's copy and receive buffer are dropped once its products are taken (under NCCL the hook also
calls ``Work.wait()``, which releases NCCL's own stash of them). Besides: chunk scratch of at most
:func:`lightning_simigrad.measurement._dots.scratch_bytes` per stream (16 MiB on a GPU, 2 MiB on CPU), and four
float64 numbers per bucket.
"""

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_simigrad import _compat
from lightning_simigrad.core.plan import Window
from lightning_simigrad.exchange import Rows
from lightning_simigrad.measurement._ddp_hook import BucketHook, Layout, Round
from lightning_simigrad.measurement.composed import ComposedMeasurement, Finished, MeasurementSkipped
from lightning_simigrad.measurement.protocol import Attachment, MeasurementError
from lightning_simigrad.measurement.rows import Outcome

__all__ = ["MeasurementError", "MeasurementSkipped", "RankGroupMeasurement", "RankGroups"]


def _hook_conflict_message(existing: str) -> str:
    return (
        f"The DistributedDataParallel model already has a communication hook ({existing}) and torch "
        "allows one per model. SimiGrad measures inside its own hook, which averages exactly like "
        "DDP's default all-reduce: remove the other hook (e.g. `DDPStrategy(ddp_comm_hook=...)`, "
        "DDP `mixed_precision`), or do not use SimiGrad's DDP measurement with it."
    )


class RankGroups:
    """The halves of DDP's synchronising backward: two groups of ranks, measured in a communication hook.

    Args:
        process_group: the group DDP synchronises over; None for the default (world) group.

    Raises:
        RuntimeError: if ``torch.distributed`` is not initialised or this rank is not in the group.
        ValueError: if the group has fewer than two ranks (there would be no two halves).
    """

    name = "DDP"
    min_micro_batches = 1  # the halves are two groups of ranks: one micro-batch per rank suffices
    midpoint_reduction = False  # measured in the window's one reduction

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "RankGroupMeasurement needs an initialised process group: call "
                "`torch.distributed.init_process_group(...)` first."
            )
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        if self.world_size < 2:
            raise ValueError(
                f"RankGroupMeasurement needs a process group of at least 2 ranks, got {self.world_size}. "
                "On one process measure the two halves of the accumulation window instead."
            )
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise RuntimeError("This rank is not a member of `process_group`.")
        self._global_ranks = dist.get_process_group_ranks(self.group)
        self._layout = Layout(self.world_size, self.rank)
        self._buckets = BucketHook(self._layout, self.group)  # type: ignore[arg-type]
        self._model: DistributedDataParallel | None = None
        self._device = torch.device("cpu")
        self._closed = False
        # A round goes armed (arm) -> active (first bucket of the next synchronising backward) ->
        # measured (its last bucket) -> collected. The hook runs on autograd's thread, the bucket
        # callbacks on the process group's threads (gloo) or inline (NCCL); each round is its own object.
        self._armed: Round | None = None
        self._active: Round | None = None
        self._measured: Round | None = None

    def group_of(self, rank: int) -> int:
        """0 if ``rank`` (a rank of the process group) is in group A (the first ``W // 2``), else 1."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"`rank` must lie in [0, {self.world_size}), got {rank}.")
        return 0 if rank < self._layout.size_a else 1

    def half_of(self, window: Window, index: int) -> int:
        return self.group_of(self.rank)

    def attach(self, target: Attachment) -> None:
        self.register(target.model)

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
        existing = _compat.comm_hook_name(ddp_model)
        if existing is not None:
            raise RuntimeError(_hook_conflict_message(existing))
        try:
            ddp_model.register_comm_hook(state=None, hook=self._make_hook())
        except RuntimeError as error:
            if "can only be called once" not in str(error):
                raise
            _compat.forget_last_comm_hook(ddp_model)  # DDP appended ours before the reducer refused it
            raise RuntimeError(_hook_conflict_message("unknown")) from error
        parameter = next(ddp_model.parameters(), None)
        self._device = parameter.device if parameter is not None else torch.device("cpu")
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
        if len(counts) != self.world_size:
            raise ValueError(f"`samples_per_rank` must hold one count per rank ({self.world_size}), got {len(counts)}.")
        if any(n < 0 for n in counts):
            raise ValueError(f"`samples_per_rank` must be non-negative, got {list(counts)}.")
        size_a = self._layout.size_a
        n_a, n_b = sum(counts[:size_a]), sum(counts[size_a:])
        if n_a == 0 or n_b == 0:
            raise ValueError(
                f"Both rank groups need samples in a measured window (group A = ranks "
                f"0..{size_a - 1}), got n_A={n_a}, n_B={n_b} from {list(counts)}."
            )
        if self._active is not None or self._measured is not None:
            raise RuntimeError(
                "The previous measurement has not been collected: call `collect()` on every rank after "
                "the synchronising backward (or `disarm()` to drop it) before arming again."
            )
        self._armed = Round(counts)

    def disarm(self) -> None:
        """Drop an armed or uncollected measurement (local, no communication). Call it on all ranks."""
        self._armed = self._active = self._measured = None

    # ------------------------------------------------------------------ the halves
    def start_micro_batch(self, window: Window, index: int, params: Sequence[torch.Tensor]) -> None:
        """Arm before the window's last micro-batch (the synchronising backward), when both groups have samples."""
        if index != window.num_micro_batches - 1:
            return
        per_rank = window.samples_per_rank()
        # a tiny epoch may leave one rank group without samples: nothing to compare
        if len({self.group_of(r) for r, n in enumerate(per_rank) if n}) == 2:
            self.arm(per_rank)

    def after_backward(self, window: Window, index: int, fed: tuple[int, int], params: Sequence[torch.Tensor]) -> None:
        """Nothing: the hook measured the synchronising backward as it ran."""

    def finish(self) -> Finished | None:
        """This rank's ``[u.u, u.g, g.g, o.o]`` of the last armed synchronisation; None when nothing was armed."""
        round = self._measured or self._armed or self._active
        self.disarm()
        if round is None:
            return None
        size_a = self._layout.size_a
        n_a, n_b = sum(round.counts[:size_a]), sum(round.counts[size_a:])
        items = (n_a, n_b, n_a + n_b)
        device = round.device or self._device
        try:
            return self._local(round, items, device)
        except Exception as error:
            round.fail_or_skip(Outcome.COLLECT, error)
            stage = Outcome.SKIPPED if round.failure is None else Outcome.COLLECT
            return Finished(None, items, stage, cause=error)

    def _local(self, round: Round, items: tuple[int, int, int], device: torch.device) -> Finished:
        if not round.started or round.num_buckets == 0:  # no backward, or one that never reached its last bucket
            return Finished(None, items, Outcome.NO_BACKWARD)
        if round.failure is not None:
            return Finished(None, items, Outcome(round.failure[0]), cause=round.failure[1])
        if round.skipped is not None:
            return Finished(None, items, Outcome.SKIPPED)
        with round.lock:
            present = [round.partials[i] for i in range(round.num_buckets) if i in round.partials]
        computing = self._layout.slot is not None
        missing = round.num_buckets - len(present) if computing else 0
        stream = self._buckets.measurement_stream(device) if device.type == "cuda" else None
        if stream is not None:  # the bucket products were made on the measurement stream
            current = torch.cuda.current_stream(device)
            current.wait_stream(stream)
            for partial in present:
                partial.record_stream(current)
        products = torch.stack(present).sum(dim=0) if present else torch.zeros(4, dtype=torch.float64, device=device)
        return Finished(products, items, missing=missing)

    def after_read(self) -> None:
        pass

    def shares(self, sums: tuple[float, float, float, float]) -> tuple[float, float, float]:
        """``(u.u, u.o, o.o)`` from the summed ``[u.u, u.g, g.g, o.o]``."""
        uu, ug, gg, oo = sums
        if self._layout.squares:  # W = 2: |g|^2 = u.u + 2 u.o + o.o, each square measured directly
            return uu, 0.5 * (gg - uu - oo), oo
        return uu, ug - uu, gg - 2.0 * ug + uu  # from u.g: u.o = u.g - u.u, o.o = g.g - 2 u.g + u.u

    def abort(self) -> None:
        """The window was abandoned: drop what was armed (see :meth:`disarm`)."""
        self.disarm()

    def close(self) -> None:
        """Stop measuring: the hook then only averages. Local and idempotent; it communicates nothing."""
        self._closed = True
        self.disarm()
        self._buckets.clear()

    # ------------------------------------------------------------------ the hook
    def _make_hook(self) -> Callable[[object, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
        # DDP checks the hook's annotations as objects: this module must not postpone them (no
        # `from __future__ import annotations`).
        def simigrad_measurement_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            return self._hook(bucket)

        return simigrad_measurement_hook

    def _hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # DDP launches a backward's buckets in index order: the first opens the armed round.
        if bucket.index() == 0 and self._armed is not None and not self._closed:
            self._active, self._armed = self._armed, None
            self._active.started = True
            self._active.device = bucket.buffer().device
        round = self._active
        if round is None:
            return self._buckets.average(bucket.buffer())
        if bucket.is_last():
            round.num_buckets = bucket.index() + 1
            self._measured, self._active = round, None
        return self._buckets.measure(round, bucket)


class RankGroupMeasurement(ComposedMeasurement):
    """Half-batch gradient statistics of DDP's synchronising backward, measured in a comm hook.

    The composition of :class:`RankGroups` with one all-gather of a row per rank, and the API to use it on a
    hand-built DDP model. Construct it on every rank (construction communicates nothing). Then per measured window:

    1. ``arm(samples_per_rank)`` on every rank before the synchronising (last) backward of the window;
    2. run the backward (DDP's gradients come out exactly as without the hook);
    3. ``collect()`` on every rank: a collective returning the same :class:`HalfStats` everywhere, or
       raising the same :class:`MeasurementError` everywhere; None when nothing was armed (on any rank:
       arm on all ranks or none). An out-of-memory error in the measurement gives NaN statistics on every
       rank and a :class:`MeasurementSkipped` warning on rank 0; the gradients are DDP's.

    Args:
        process_group: the group DDP synchronises over; None for the default (world) group.

    Example::

        measurement = RankGroupMeasurement()
        measurement.register(ddp_model)
        ...
        measurement.arm(samples_per_rank)  # before the backward that synchronises
        loss.backward()
        stats = measurement.collect(loss_scale=scaler)  # HalfStats, identical on all ranks
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        groups = RankGroups(process_group)
        super().__init__(groups, Rows(groups.group, what="DDP"), rank=groups.rank)
        self.groups = groups

    @property
    def world_size(self) -> int:
        return self.groups.world_size

    def group_of(self, rank: int) -> int:
        return self.groups.group_of(rank)

    def register(self, ddp_model: DistributedDataParallel) -> None:
        self.groups.register(ddp_model)

    def arm(self, samples_per_rank: Sequence[int]) -> None:
        self.groups.arm(samples_per_rank)

    def disarm(self) -> None:
        self.groups.disarm()

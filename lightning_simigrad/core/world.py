"""The world size the batch wants: how many devices would run a step with at most a given accumulation per rank.

Pure Python, no Lightning. On a fixed world an adaptive batch saves optimizer steps, not device-hours: while the
batch is small the devices sit underfilled, and late one step is many micro-batches on every rank. The devices pay
only when they follow the batch. :class:`WorldRule` says what world a step's batch wants; :class:`WorldWanted` keeps
that answer steady (it grows as soon as the batch needs more devices than it has, and shrinks only once the batch
would fit on ``shrink_at`` of them, so a batch that hovers at a boundary does not flap between two sizes); and
:class:`ResizeTrigger` says when the wanted size has differed from the current one by at least ``resize_factor``, for
``patience`` steps in a row, long enough to be worth a restart.

Worlds count in whole nodes: a world is ``nodes x devices_per_node`` ranks.

>>> rule = WorldRule(max_accumulation=4, devices_per_node=2, max_nodes=8)
>>> rule.world(batch=64, micro_batch=8)  # 8 micro-batches, 4 a rank at most: 2 ranks, one node
2
>>> rule.world(batch=640, micro_batch=8)  # 80 micro-batches: 20 ranks, but 8 nodes at most
16
>>> rule.world(batch=6, micro_batch=8)  # one micro-batch: the smallest world, one node
2
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Elastic", "ResizeRequest", "ResizeTrigger", "WorldRule", "WorldWanted"]

ON_REQUEST = ("stop", "continue")


@dataclass(frozen=True)
class WorldRule:
    """The world size a batch wants.

    Args:
        max_accumulation: the most micro-batches a rank may take in one step (>= 1): a step of more wants more ranks.
        devices_per_node: the ranks a node adds (worlds are multiples of it).
        min_nodes: the fewest nodes (>= 1).
        max_nodes: the most nodes (None: unbounded).
        min_samples_per_rank: the fewest samples (or tokens) a rank must hold for a measured step: a world never
            grows past ``batch / min_samples_per_rank`` ranks (a measurement needs a sample in each half's slot on
            every rank).

    Raises:
        ValueError: for an argument out of range; the message names it and says the fix.
    """

    max_accumulation: int
    devices_per_node: int = 1
    min_nodes: int = 1
    max_nodes: int | None = None
    min_samples_per_rank: float = 2.0

    def __post_init__(self) -> None:
        for name in ("max_accumulation", "devices_per_node", "min_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` = {value!r}: it must be an int >= 1.")
        if self.max_nodes is not None and (not isinstance(self.max_nodes, int) or self.max_nodes < self.min_nodes):
            raise ValueError(
                f"`max_nodes` = {self.max_nodes!r} with `min_nodes` = {self.min_nodes}: give an int >= `min_nodes`,"
                " or None for no upper bound."
            )
        if not (isinstance(self.min_samples_per_rank, (int, float)) and self.min_samples_per_rank > 0):
            raise ValueError(f"`min_samples_per_rank` = {self.min_samples_per_rank!r}: it must be a positive number.")

    def nodes(self, batch: float, micro_batch: float) -> int:
        """The nodes that run a step of ``batch`` (samples, or tokens) in micro-batches of at most ``micro_batch`` with
        at most ``max_accumulation`` micro-batches a rank, within the bounds."""
        if not (batch > 0 and micro_batch > 0):
            raise ValueError(f"`batch` = {batch!r}, `micro_batch` = {micro_batch!r}: both must be positive.")
        micro_batches = math.ceil(batch / micro_batch)
        ranks = math.ceil(micro_batches / self.max_accumulation)
        # never more ranks than the batch can feed a measured step on each
        ranks = min(ranks, max(1, math.floor(batch / self.min_samples_per_rank)))
        nodes = max(self.min_nodes, math.ceil(ranks / self.devices_per_node))
        return nodes if self.max_nodes is None else min(nodes, self.max_nodes)

    def world(self, batch: float, micro_batch: float) -> int:
        """:meth:`nodes`, in ranks."""
        return self.nodes(batch, micro_batch) * self.devices_per_node


@dataclass
class WorldWanted:
    """The wanted world, held steady: it grows to the rule's answer at once (the batch needs those devices to keep
    to ``max_accumulation``), and shrinks to it only once that answer is at most ``shrink_at`` of the wanted nodes.

    Args:
        rule: the :class:`WorldRule`.
        nodes: the nodes wanted before the first step (the current world's).
        shrink_at: a share in (0, 1]: how far below the wanted nodes the rule's answer must fall before the wanted
            size follows it down (1: no hysteresis).

    >>> wanted = WorldWanted(WorldRule(max_accumulation=2), nodes=1, shrink_at=0.5)
    >>> [wanted.update(batch, micro_batch=2) for batch in (4, 12, 8, 12, 8, 4)]  # 12 wants 3 nodes, 8 two, 4 one
    [1, 3, 3, 3, 3, 1]
    """

    rule: WorldRule
    nodes: int = 1
    shrink_at: float = 0.5

    def __post_init__(self) -> None:
        if not (0 < self.shrink_at <= 1):
            raise ValueError(f"`shrink_at` = {self.shrink_at!r}: it must lie in (0, 1] (1: no hysteresis).")

    def update(self, batch: float, micro_batch: float) -> int:
        """The wanted nodes after a step asks for ``batch``."""
        answer = self.rule.nodes(batch, micro_batch)
        if answer > self.nodes or answer <= self.shrink_at * self.nodes:
            self.nodes = answer
        return self.nodes

    @property
    def world(self) -> int:
        return self.nodes * self.rule.devices_per_node


@dataclass
class ResizeTrigger:
    """When to ask for the wanted world: once it has differed from the current one by at least ``resize_factor``
    (either way) on ``patience`` steps in a row.

    Args:
        resize_factor: >= 1, the ratio of wanted to current nodes (or its inverse) worth a restart.
        patience: steps in a row (>= 1).

    >>> trigger = ResizeTrigger(resize_factor=2.0, patience=3)
    >>> [trigger.update(wanted, current=1) for wanted in (2, 2, 1, 2, 2, 2)]
    [False, False, False, False, False, True]
    """

    resize_factor: float = 2.0
    patience: int = 1
    streak: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        factor = self.resize_factor
        if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor >= 1):
            raise ValueError(f"`resize_factor` = {factor!r}: it must be a number >= 1 (wanted over current nodes).")
        if not isinstance(self.patience, int) or isinstance(self.patience, bool) or self.patience < 1:
            raise ValueError(f"`patience` = {self.patience!r}: it must be an int >= 1 (steps in a row).")

    def update(self, wanted: int, current: int) -> bool:
        """Whether the wanted nodes, after this step, have differed from ``current`` long enough."""
        far = wanted != current and max(wanted / current, current / wanted) >= self.resize_factor
        self.streak = self.streak + 1 if far else 0
        return self.streak >= self.patience


@dataclass(frozen=True)
class ResizeRequest:
    """What a run asks its launcher or cluster manager for: a world of ``nodes`` (``world_size`` ranks), resumed from
    ``checkpoint`` (exact, written at the boundary after optimizer step ``step``). Written as JSON beside the
    checkpoint (:meth:`write`), and handed to :attr:`Elastic.on_request` where that is a function."""

    nodes: int
    world_size: int
    devices_per_node: int
    checkpoint: str
    step: int
    samples_seen: int
    batch_size: int
    current_nodes: int
    current_world_size: int
    reason: str

    def write(self, path: str | os.PathLike[str]) -> None:
        """Into ``path`` whole or not at all: a reader never sees half a request."""
        partial = f"{os.fspath(path)}.partial"
        with open(partial, "w") as f:
            json.dump(asdict(self), f, indent=2)
            f.write("\n")
        os.replace(partial, path)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ResizeRequest:
        with open(path) as f:
            return cls(**json.load(f))


@dataclass(frozen=True)
class Elastic:
    """Devices that follow the batch: ``SimiGrad(elastic=Elastic(...))`` logs the world size every step's batch wants
    (``simigrad/world_size_wanted``) and, once the wanted size has differed from the current one by at least
    ``resize_factor`` for ``patience`` steps in a row, writes an exact checkpoint at the step's boundary with a
    :class:`ResizeRequest` beside it, then acts as ``on_request`` says. A SIGTERM (what TorchElastic sends before it
    restarts the workers at a new world size) saves an exact checkpoint there too. docs/distributed.md, "Devices that
    follow the batch".

    Args:
        max_accumulation: the most micro-batches a rank should take in one step: a step of more wants more ranks.
        devices_per_node: ranks per node (default: the Trainer's devices).
        min_nodes, max_nodes: the bounds on the nodes wanted (``max_nodes`` None: unbounded).
        shrink_at: the wanted size follows the batch down only once the batch would fit on this share of it.
        resize_factor: how far (either way) the wanted nodes must lie from the current ones to ask (>= 1).
        patience: for how many steps in a row (>= 1).
        on_request: ``"stop"``: end the fit cleanly (a job script relaunches at the wanted size, resuming the
            request's checkpoint); ``"continue"``: keep training (a cluster manager reads the request and changes the
            membership, and TorchElastic restarts the workers); or a function of the :class:`ResizeRequest`, called on
            every rank after the checkpoint is written, for a manager of your own.
        dirpath: where the checkpoint (``last-simigrad.ckpt``, which ``ckpt_path="last"`` finds beside a
            ``ModelCheckpoint``'s) and the request (``simigrad-resize.json``) go (default: the first
            ``ModelCheckpoint``'s directory, else ``<default_root_dir>/checkpoints``).
        save_on_sigterm: save the exact checkpoint when the process receives SIGTERM.

    Raises:
        ValueError: for an argument out of range; the message names it and says the fix.
    """

    max_accumulation: int
    devices_per_node: int | None = None
    min_nodes: int = 1
    max_nodes: int | None = None
    shrink_at: float = 0.5
    resize_factor: float = 2.0
    patience: int = 10
    on_request: str | Callable[[ResizeRequest], Any] = "stop"
    dirpath: str | os.PathLike[str] | None = None
    save_on_sigterm: bool = True

    CHECKPOINT = "last-simigrad.ckpt"
    REQUEST = "simigrad-resize.json"

    def __post_init__(self) -> None:
        # each piece checks its own arguments
        self.rule(1 if self.devices_per_node is None else self.devices_per_node)
        WorldWanted(WorldRule(1), shrink_at=self.shrink_at)
        ResizeTrigger(self.resize_factor, self.patience)
        if not (callable(self.on_request) or self.on_request in ON_REQUEST):
            raise ValueError(
                f"`on_request` = {self.on_request!r}: give one of {ON_REQUEST} or a function of the ResizeRequest."
            )

    def rule(self, devices_per_node: int, min_samples_per_rank: float = 2.0) -> WorldRule:
        return WorldRule(self.max_accumulation, devices_per_node, self.min_nodes, self.max_nodes, min_samples_per_rank)

"""SimiGrad's checkpointed state: its format, composed of the pieces its components own, and the checks it passes.

The callback saves one dict under its ``state_key`` in Lightning's checkpoint. Every component saves and restores
its own piece, under its own key, and declares the piece's fields beside its ``state_dict`` (as Lightning's loops
compose theirs):

- ``run``: B0, the world size and the epoch's length the fit was set up with
  (:class:`~lightning_simigrad.core.counts.FitFacts`);
- ``counts``: optimizer steps, samples and weight trained, the epoch's position
  (:class:`~lightning_simigrad.core.counts.FitCounts`);
- ``schedule``: the batch size asked for, the shuffling seed, the epoch, the batch sizes of the windows planned but
  not trained (:class:`~lightning_simigrad.data.schedule.WindowSchedule`);
- ``controller``: the rule's state, its averages and measured steps
  (:class:`~lightning_simigrad.core.controller.BatchSizeController`);
- ``progress``: the step-interval schedulers' steps counted in samples
  (:class:`~lightning_simigrad.core.counts.SchedulerSteps`);
- ``rng``: every rank's random generator states, optional (:mod:`lightning_simigrad.state.rng`);
- ``stream``: every process's stream loader state before the first window not trained, optional: only for a stream
  whose loader has ``state_dict`` (:mod:`lightning_simigrad.data.stream`); ``stream_skip``, beside it, the samples
  each process passes over after that state (those of a window the fit's budget cut), optional;

plus ``format_version``. ``tests/state/test_checkpoint.py`` spells the structure out. :func:`validate_state` runs
when Lightning restores the callback, before the first step, and refuses -- with the checkpoint's path, the field,
the value and what to do -- a state that is malformed (damaged, edited, written by another program) or written in
a format this version cannot read. A run never starts from a state it would misread.

Format history:

- 2: the state composed of its owners' pieces (above); ``counts.weight_seen`` counts what batch sizes count.
- 1: one flat dict (``initial_batch_size``, ``samples_seen``, ``steps``, ``epoch_samples_done``,
  ``epoch_length``, ``world_size``, ``batch_size``, ``seed``, ``epoch``, ``planned``, ``controller``,
  ``progress``, ``rng``). Still read: :func:`from_format_1` arranges it into format 2. Its earliest writers
  also saved ``accumulation``, which nothing reads, and the noise scale's averages under former names
  (:attr:`BatchSizeController.FORMER_NOISE_FIELDS`), whose averages start afresh.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_simigrad.core.controller import BatchSizeController
from lightning_simigrad.core.counts import FitCounts, FitFacts, SchedulerSteps
from lightning_simigrad.core.fields import DICT, NON_NEGATIVE_INT, Field, check_piece
from lightning_simigrad.data.schedule import SchedulePiece, WindowSchedule
from lightning_simigrad.data.stream import StreamPosition
from lightning_simigrad.state.rng import check_rng

__all__ = ["FORMAT_VERSION", "Saved", "compose", "from_format_1", "validate_state", "with_every_rank"]

FORMAT_VERSION = 2

# key -> the fields its owner declares (the controller's depend on the state: see `_fields_of`)
PIECES: dict[str, dict[str, Field]] = {
    "run": FitFacts.STATE_FIELDS,
    "counts": FitCounts.STATE_FIELDS,
    "schedule": WindowSchedule.STATE_FIELDS,
    "controller": BatchSizeController.STATE_FIELDS,
    "progress": SchedulerSteps.STATE_FIELDS,
}


def compose(pieces: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The state a checkpoint holds: the format version and every component's piece, in the table's order."""
    return {"format_version": FORMAT_VERSION, **{key: dict(pieces[key]) for key in PIECES}}


def with_every_rank(
    state: dict[str, Any], generators: list[Any], streams: list[StreamPosition | None] | None
) -> dict[str, Any]:
    """``state`` with every rank's pieces: its generator states and, for a stream whose loader keeps its position,
    where its stream resumes."""
    state["rng"] = list(generators)
    if streams is not None:
        state["stream"] = [p.loader_state if p is not None else None for p in streams]
        state["stream_skip"] = [p.skip if p is not None else 0 for p in streams]
    return state


@dataclass(frozen=True)
class Saved:
    """SimiGrad's state as a checkpoint holds it (validated), read: each piece typed where another component reads it,
    handed to its owner otherwise.

    Args:
        facts: what the fit was set up with (B0 carries over).
        counts: where the fit and its epoch stood.
        schedule: the batch size asked for, the epoch, the windows planned and not trained.
        controller: the controller's piece (only the controller reads it).
        progress: the step-interval schedulers' piece (only they read it).
        generators: every rank's generator states, where written.
        streams: every rank's stream position, for a stream whose loader keeps one.
    """

    facts: FitFacts
    counts: FitCounts
    schedule: SchedulePiece
    controller: dict[str, Any]
    progress: dict[str, Any]
    generators: list[Any] | None = None
    streams: list[StreamPosition | None] | None = None

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> Saved:
        """A format-2 state read (``validate_state`` checks it first)."""
        streams = state.get("stream")
        skips = state.get("stream_skip") or [0] * len(streams or [])
        return cls(
            FitFacts.of(state["run"]),
            FitCounts.of(state["counts"]),
            SchedulePiece.of(state["schedule"]),
            dict(state["controller"]),
            dict(state["progress"]),
            state.get("rng"),
            None if streams is None else [StreamPosition(s, skip) for s, skip in zip(streams, skips, strict=True)],
        )

    def state_dict(self) -> dict[str, Any]:
        """The state a checkpoint holds, as it was read."""
        pieces = {
            "run": self.facts.state_dict(),
            "counts": self.counts.state_dict(),
            "schedule": self.schedule.state_dict(),
            "controller": self.controller,
            "progress": self.progress,
        }
        state = compose(pieces)
        return state if self.generators is None else with_every_rank(state, self.generators, self.streams)


def validate_state(state: Any, where: str) -> dict[str, Any]:
    """``state`` in format 2 if it is a SimiGrad state this version reads; raise ``ValueError`` otherwise.

    Args:
        state: what the checkpoint holds under the callback's ``state_key``.
        where: the checkpoint, for the message (its path, or a description).

    >>> validate_state({"format_version": 3}, "last.ckpt")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: The SimiGrad state in last.ckpt has `format_version` 3; this lightning_simigrad reads formats 1 ...
    """
    prefix = f"The SimiGrad state in {where}"
    if not isinstance(state, dict):
        raise ValueError(
            f"{prefix} is a `{type(state).__name__}`, not a dict: the file is damaged or was not written by SimiGrad."
            " Resume from another checkpoint, or start without `ckpt_path`."
        )
    version = state.get("format_version")
    if version is None:
        raise ValueError(
            f"{prefix} has no `format_version`: it was written by a development version of lightning_simigrad"
            " older than checkpoint format 1, whose state cannot be resumed exactly. Resume from a checkpoint"
            " written by this version, or start without `ckpt_path`."
        )
    if version == 1:
        _check(state, _FORMAT_1, prefix, "")
        state = from_format_1(state)
    elif version != FORMAT_VERSION:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
        fix = (
            "Upgrade lightning_simigrad to the version that wrote it."
            if newer
            else "Resume from a checkpoint written by this version, or start without `ckpt_path`."
        )
        raise ValueError(
            f"{prefix} has `format_version` {version!r}; this lightning_simigrad reads formats 1 and"
            f" {FORMAT_VERSION}. {fix}"
        )
    _check(state, {key: DICT for key in PIECES}, prefix, "")
    for key, fields in PIECES.items():
        if key == "controller":
            fields = BatchSizeController.state_fields(state[key])
        _check(state[key], fields, prefix, f"{key}.")
    if state.get("rng") is not None:
        check_rng(state["rng"], prefix)
    if state.get("stream") is not None and not isinstance(state["stream"], list):
        raise ValueError(
            f"{prefix} has `stream` = a `{type(state['stream']).__name__}`, which must be a list of every process's"
            " loader state: the file is damaged or was edited. Resume from another checkpoint, or start without"
            " `ckpt_path`."
        )
    skip = state.get("stream_skip")
    if skip is not None and not (
        isinstance(skip, list)
        and len(skip) == len(state.get("stream") or [])
        and all(NON_NEGATIVE_INT.check(n) for n in skip)
    ):
        raise ValueError(
            f"{prefix} has `stream_skip` = {skip!r}, which must list a non-negative int for every process's loader"
            " state in `stream`: the file is damaged or was edited. Resume from another checkpoint, or start without"
            " `ckpt_path`."
        )
    done, length = state["counts"]["epoch_samples_done"], state["run"]["epoch_length"]
    if length is not None and done > length:
        raise ValueError(
            f"{prefix} is inconsistent: `counts.epoch_samples_done` ({done}) exceeds `run.epoch_length` ({length})."
            " The file is damaged; resume from another checkpoint."
        )
    return state


def from_format_1(state: dict[str, Any]) -> dict[str, Any]:
    """A format-1 state (one flat dict, checked) arranged as format 2: every value where its owner reads it.

    >>> old = {"format_version": 1, "initial_batch_size": 8, "samples_seen": 40, "steps": 5, "epoch_samples_done": 0,
    ...        "epoch_length": 40, "world_size": 1, "batch_size": 9, "seed": 3, "epoch": 1, "planned": [],
    ...        "controller": {}, "progress": {}}
    >>> new = from_format_1(old)
    >>> new["counts"], new["schedule"]["batch_size"], new["format_version"]
    ({'steps': 5, 'samples_seen': 40, 'weight_seen': 40, 'epoch_samples_done': 0}, 9, 2)
    """
    new = {
        "format_version": FORMAT_VERSION,
        "run": {name: state[name] for name in FitFacts.STATE_FIELDS},
        "counts": {
            "steps": state["steps"],
            "samples_seen": state["samples_seen"],
            "weight_seen": state["samples_seen"],  # format 1 counted batches in samples only
            "epoch_samples_done": state["epoch_samples_done"],
        },
        "schedule": {name: state[name] for name in WindowSchedule.STATE_FIELDS if name in state},  # (added later)
        "controller": state["controller"],
        "progress": state["progress"],
    }
    if state.get("rng") is not None:
        new["rng"] = state["rng"]
    return new


# format 1's top-level fields (the pieces inside it are checked once arranged as format 2)
_FORMAT_1 = {
    **FitFacts.STATE_FIELDS,
    **{name: field for name, field in FitCounts.STATE_FIELDS.items() if name != "weight_seen"},
    **WindowSchedule.STATE_FIELDS,
    "controller": DICT,
    "progress": DICT,
}


def _check(state: Mapping[str, Any], fields: Mapping[str, Field], prefix: str, path: str) -> None:
    found = check_piece(state, fields)
    if found is None:
        return
    name, value, expected = found
    if value is ...:
        raise ValueError(
            f"{prefix} lacks `{path}{name}`: the file is damaged or was edited."
            " Resume from another checkpoint, or start without `ckpt_path`."
        )
    raise ValueError(
        f"{prefix} has `{path}{name}` = {value!r}, which must be {expected}: the file is damaged or"
        " was edited. Resume from another checkpoint, or start without `ckpt_path`."
    )

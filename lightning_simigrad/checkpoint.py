"""SimiGrad's checkpointed state: its format, and the checks a checkpoint passes before a run resumes from it.

The callback saves a dict of plain scalars and lists under its ``state_key`` in Lightning's checkpoint. This
module owns its shape. :func:`validate_state` runs when Lightning restores the callback, before the first step,
and refuses -- with the checkpoint's path, the field, the value and what to do -- a state that is malformed
(damaged, edited, written by another program) or written in a format this version cannot read. A run never
starts from a state it would misread.

Format history:

- 1: the first versioned format. Besides the batch size, controller, counters and shuffling seed it records
  the batch sizes of the windows planned but not yet trained when it was written (``planned``), the world
  size and the epoch's sample count, so that a run resumed in the middle of an epoch trains exactly the
  windows the uninterrupted run would have; and (optional) ``rng``, every rank's random generator states
  (:mod:`lightning_simigrad.rng`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = ["FORMAT_VERSION", "validate_state"]

FORMAT_VERSION = 1


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _positive_int(value: Any) -> bool:
    return _non_negative_int(value) and value > 0


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _ema(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(_finite_number(v) for v in value)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, (list, tuple)) and all(check(v) for v in value)


# field -> (check, what the value must be)
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "batch_size": (_positive_int, "a positive int"),
    "initial_batch_size": (_positive_int, "a positive int"),
    "samples_seen": (_non_negative_int, "a non-negative int"),
    "steps": (_non_negative_int, "a non-negative int"),
    "seed": (_non_negative_int, "a non-negative int"),
    "epoch": (_non_negative_int, "a non-negative int"),
    "epoch_samples_done": (_non_negative_int, "a non-negative int"),
    "epoch_length": (_non_negative_int, "a non-negative int"),
    "world_size": (_positive_int, "a positive int"),
    "planned": (_list_of(_positive_int), "a list of positive ints"),
    "controller": (lambda v: isinstance(v, dict), "a dict"),
    "progress": (lambda v: isinstance(v, dict), "a dict"),
}
_CONTROLLER_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "size": (lambda v: _finite_number(v) and v > 0, "a positive number"),
    "measured_steps": (_non_negative_int, "a non-negative int"),
    "similarity_ema": (_ema, "two finite numbers"),
    "grad_sq_ema": (_ema, "two finite numbers"),
    "trace_sigma_ema": (_ema, "two finite numbers"),
}
_PROGRESS_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "scheduler_steps": (_list_of(_non_negative_int), "a list of non-negative ints"),
}


def validate_state(state: Any, where: str) -> dict[str, Any]:
    """Return ``state`` if it is a SimiGrad state this version reads; raise ``ValueError`` otherwise.

    Args:
        state: what the checkpoint holds under the callback's ``state_key``.
        where: the checkpoint, for the message (its path, or a description).

    >>> validate_state({"format_version": 2}, "last.ckpt")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: The SimiGrad state in last.ckpt has `format_version` 2; this lightning_simigrad reads format 1. ...
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
            f" older than checkpoint format {FORMAT_VERSION}, whose state cannot be resumed exactly. Resume from a"
            " checkpoint written by this version, or start without `ckpt_path`."
        )
    if version != FORMAT_VERSION:
        newer = _non_negative_int(version) and version > FORMAT_VERSION
        fix = (
            "Upgrade lightning_simigrad to the version that wrote it."
            if newer
            else "Resume from a checkpoint written by this version, or start without `ckpt_path`."
        )
        raise ValueError(
            f"{prefix} has `format_version` {version!r}; this lightning_simigrad reads format {FORMAT_VERSION}. {fix}"
        )
    _check_fields(state, _FIELDS, prefix, "")
    _check_fields(state["controller"], _CONTROLLER_FIELDS, prefix, "controller.")
    _check_fields(state["progress"], _PROGRESS_FIELDS, prefix, "progress.")
    rng = state.get("rng")
    if rng is not None and not (isinstance(rng, list) and all(isinstance(r, dict) and "torch" in r for r in rng)):
        raise ValueError(
            f"{prefix} has an `rng` that is not a list of random generator states: the file is damaged or was"
            " edited. Delete the `rng` entry to resume without restoring them, or resume from another checkpoint."
        )
    if state["epoch_samples_done"] > state["epoch_length"]:
        raise ValueError(
            f"{prefix} is inconsistent: `epoch_samples_done` ({state['epoch_samples_done']}) exceeds `epoch_length`"
            f" ({state['epoch_length']}). The file is damaged; resume from another checkpoint."
        )
    return state


def _check_fields(
    state: dict[str, Any], fields: dict[str, tuple[Callable[[Any], bool], str]], prefix: str, path: str
) -> None:
    for name, (check, expected) in fields.items():
        if name not in state:
            raise ValueError(
                f"{prefix} lacks `{path}{name}`: the file is damaged or was edited."
                " Resume from another checkpoint, or start without `ckpt_path`."
            )
        if not check(state[name]):
            raise ValueError(
                f"{prefix} has `{path}{name}` = {state[name]!r}, which must be {expected}: the file is damaged or"
                " was edited. Resume from another checkpoint, or start without `ckpt_path`."
            )

"""SimiGrad's checkpointed state: its format, and the checks a checkpoint passes before a run resumes from it.

The callback saves a dict of plain scalars and lists under its ``state_key`` in Lightning's checkpoint, composed
of the pieces its components hand (and get back when a fit resumes, :mod:`lightning_simigrad.state.resume`):

- the run (:meth:`lightning_simigrad.run.Run.state_dict`): ``format_version``, ``initial_batch_size``,
  ``samples_seen``, ``steps``, ``epoch_samples_done``, ``epoch_length``, ``world_size``;
- the window schedule (:meth:`lightning_simigrad.data.schedule.WindowSchedule.state_dict`): ``batch_size``,
  ``seed``, ``epoch``, ``planned``;
- the controller: ``controller``; the step schedules counted in samples: ``progress``;
- every rank's random generator states: ``rng`` (:mod:`lightning_simigrad.state.rng`).

This module owns the shape (``tests/test_checkpoint.py`` spells it out). :func:`validate_state` runs when
Lightning restores the callback, before the first step, and refuses -- with the checkpoint's path, the field, the
value and what to do -- a state that is malformed (damaged, edited, written by another program) or written in a
format this version cannot read. A run never starts from a state it would misread, and never stops at its first
batch on random generator states it cannot restore: every rank's are checked, field by field, as
:mod:`lightning_simigrad.state.rng` writes them.

Format history:

- 1: the first versioned format. Besides the batch size, controller, counters and shuffling seed it records
  the batch sizes of the windows planned but not yet trained when it was written (``planned``), the world
  size and the epoch's sample count, so that a run resumed in the middle of an epoch trains exactly the
  windows the uninterrupted run would have; and (optional) ``rng``, every rank's random generator states
  (:mod:`lightning_simigrad.state.rng`). Earlier writers of format 1 also saved ``accumulation`` (the micro-batches of
  the last window), which nothing reads: it is no longer written, and ignored where present. They also saved the
  noise scale's averages of the raw |G|^2 and tr(Sigma) (``grad_sq_ema``, ``trace_sigma_ema``), later in units of
  each step's own gradient size (``relative_grad_sq_ema``, ``relative_trace_sigma_ema``); the controller now keeps
  finite-population estimates in units of the step before's gradient size (``referenced_grad_sq_ema``,
  ``referenced_trace_sigma_ema``, ``reference``) and starts those averages afresh from such a checkpoint.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import torch

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
    "referenced_grad_sq_ema": (_ema, "two finite numbers"),
    "referenced_trace_sigma_ema": (_ema, "two finite numbers"),
    "reference": (lambda v: _finite_number(v) and v >= 0, "a non-negative number"),
}
# what earlier writers of format 1 saved instead of the noise scale's averages (checked, then not read): the averages
# in units of each step's own gradient size, and before them the raw averages
_NEW_NOISE_FIELDS = ("referenced_grad_sq_ema", "referenced_trace_sigma_ema", "reference")
_OLD_NOISE_EMAS = (("relative_grad_sq_ema", "relative_trace_sigma_ema"), ("grad_sq_ema", "trace_sigma_ema"))
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
    controller_fields = dict(_CONTROLLER_FIELDS)
    if not any(name in state["controller"] for name in _NEW_NOISE_FIELDS):
        for old in _OLD_NOISE_EMAS:
            if any(name in state["controller"] for name in old):
                for name in _NEW_NOISE_FIELDS:
                    del controller_fields[name]
                controller_fields.update({name: (_ema, "two finite numbers") for name in old})
                break
    _check_fields(state["controller"], controller_fields, prefix, "controller.")
    _check_fields(state["progress"], _PROGRESS_FIELDS, prefix, "progress.")
    if state.get("rng") is not None:
        _check_rng(state["rng"], prefix)
    if state["epoch_samples_done"] > state["epoch_length"]:
        raise ValueError(
            f"{prefix} is inconsistent: `epoch_samples_done` ({state['epoch_samples_done']}) exceeds `epoch_length`"
            f" ({state['epoch_length']}). The file is damaged; resume from another checkpoint."
        )
    return state


def _torch_state_bytes() -> int:
    return int(torch.get_rng_state().numel())


_MT_WORDS = 624  # the Mersenne Twister's state (Python's `random`, NumPy's legacy generator): 624 32-bit words


def _word(value: Any) -> bool:
    return _non_negative_int(value) and value < 2**32


def _python_state(value: Any) -> bool:
    """``[version, internal, gauss]`` as ``random.getstate()`` returns it: 624 words and a position of at most 624."""
    if not (isinstance(value, (list, tuple)) and len(value) == 3):
        return False
    version, internal, gauss = value
    return (
        version == random.getstate()[0]
        and isinstance(internal, (list, tuple))
        and len(internal) == _MT_WORDS + 1
        and all(_word(word) for word in internal)
        and internal[-1] <= _MT_WORDS
        and (gauss is None or isinstance(gauss, float))
    )


def _numpy_state(value: Any) -> bool:
    """``[kind, keys, position, has_gauss, cached_gaussian]`` as ``numpy.random.get_state()`` returns it."""
    if not (isinstance(value, (list, tuple)) and len(value) == 5):
        return False
    kind, keys, position, has_gauss, cached = value
    return (
        kind == "MT19937"
        and isinstance(keys, (list, tuple))
        and len(keys) == _MT_WORDS
        and all(_word(key) for key in keys)
        and _non_negative_int(position)
        and position <= _MT_WORDS
        and has_gauss in (0, 1)
        and _finite_number(cached)
    )


def _bytes_of(length: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, bytes) and len(value) == length


_CUDA_STATE_BYTES = 16  # a CUDA generator's seed and Philox offset


def _rng_fields() -> dict[str, tuple[Callable[[Any], bool], str, str, bool]]:
    """field -> (check, what it holds, what it must be, required), as :func:`lightning_simigrad.state.rng.rng_state`
    writes it."""
    words = f"{_MT_WORDS} ints in [0, 2**32)"
    return {
        "torch": (_bytes_of(_torch_state_bytes()), "torch CPU generator state", f"{_torch_state_bytes()} bytes", True),
        "python": (
            _python_state,
            "Python `random` state",
            f"a list [3, {_MT_WORDS + 1} ints ({words} and a position of at most {_MT_WORDS}), None or a float]",
            True,
        ),
        "cuda": (_bytes_of(_CUDA_STATE_BYTES), "CUDA generator state", f"{_CUDA_STATE_BYTES} bytes", False),
        "numpy": (
            _numpy_state,
            "NumPy global generator state",
            f"a list ['MT19937', {words}, a position of at most {_MT_WORDS}, 0 or 1, a finite float]",
            False,
        ),
    }


def _short(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({len(value)} bytes)" if isinstance(value, bytes) else text


def _check_rng(rng: Any, prefix: str) -> None:
    """Every rank's random generator states are whole: restoring them cannot fail in the middle of training."""
    fix = (
        "The file is damaged or was edited. Delete the `rng` entry to resume without restoring the random generator"
        " states, or resume from another checkpoint."
    )
    if not isinstance(rng, list):
        raise ValueError(f"{prefix} has `rng` = {_short(rng)}, which must be a list of every rank's states. {fix}")
    fields = _rng_fields()
    for rank, entry in enumerate(rng):
        if not isinstance(entry, dict):
            raise ValueError(
                f"{prefix} has `rng[{rank}]` = {_short(entry)}: rank {rank}'s random generator states must be a dict."
                f" {fix}"
            )
        for name, (check, what, expected, required) in fields.items():
            if name not in entry:
                if required:
                    raise ValueError(f"{prefix} lacks `rng[{rank}].{name}`, rank {rank}'s {what}. {fix}")
                continue
            if not check(entry[name]):
                raise ValueError(
                    f"{prefix} has `rng[{rank}].{name}` = {_short(entry[name])}: rank {rank}'s {what} must be"
                    f" {expected}. {fix}"
                )


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

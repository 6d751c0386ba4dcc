"""The fields of a checkpointed state and their checks, declared by the component that owns the state.

Every component that saves a piece of SimiGrad's checkpoint (the controller, the counts, the window schedule,
the step schedules) declares the fields of its piece as ``STATE_FIELDS``, beside its ``state_dict``;
:mod:`lightning_simigrad.state.checkpoint` checks a restored checkpoint against them before anything trains.
A new counter is one field here and one line in its owner's ``state_dict``.

>>> NON_NEGATIVE_INT.check(3), NON_NEGATIVE_INT.check(True), list_of(POSITIVE_INT, "positive ints").check([1, 0])
(True, False, False)
>>> check_piece({"steps": -1}, {"steps": NON_NEGATIVE_INT})
('steps', -1, 'a non-negative int')
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BOOL",
    "DICT",
    "EMA",
    "FINITE_NUMBER",
    "NON_NEGATIVE_INT",
    "NON_NEGATIVE_NUMBER",
    "POSITIVE_INT",
    "POSITIVE_NUMBER",
    "Field",
    "added_later",
    "check_piece",
    "list_of",
    "optional",
]


_REQUIRED: Any = object()


@dataclass(frozen=True)
class Field:
    """A field's check, what its value must be (for the message when it is not), and, for a field a later version
    added, what a checkpoint written before it reads as (:func:`added_later`)."""

    check: Callable[[Any], bool]
    expected: str
    default: Any = _REQUIRED

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


NON_NEGATIVE_INT = Field(_non_negative_int, "a non-negative int")
FINITE_NUMBER = Field(_finite_number, "a finite number")
POSITIVE_INT = Field(lambda v: _non_negative_int(v) and v > 0, "a positive int")
POSITIVE_NUMBER = Field(lambda v: _finite_number(v) and v > 0, "a positive number")
NON_NEGATIVE_NUMBER = Field(lambda v: _finite_number(v) and v >= 0, "a non-negative number")
EMA = Field(
    lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_finite_number(x) for x in v), "two finite numbers"
)
DICT = Field(lambda v: isinstance(v, dict), "a dict")
BOOL = Field(lambda v: isinstance(v, bool), "a bool")


def list_of(field: Field, expected: str) -> Field:
    """A list whose every element passes ``field``'s check; ``expected`` says so in words."""
    return Field(lambda v: isinstance(v, (list, tuple)) and all(field.check(x) for x in v), expected)


def optional(field: Field) -> Field:
    return Field(lambda v: v is None or field.check(v), f"{field.expected} or None")


def added_later(field: Field, default: Any) -> Field:
    """``field``, added to a piece after checkpoints were written without it: those read as ``default``.

    >>> check_piece({}, {"epoch_offset": added_later(NON_NEGATIVE_INT, 0)}) is None
    True
    """
    return Field(field.check, field.expected, default)


def check_piece(piece: Mapping[str, Any], fields: Mapping[str, Field]) -> tuple[str, Any, str] | None:
    """The first field of ``piece`` that is missing or fails its check, as ``(name, value, expected)``; None if all
    pass. A missing field reads as ``(name, ..., expected)``, unless a later version added it."""
    for name, field in fields.items():
        if name not in piece:
            if field.required:
                return name, ..., field.expected
            continue
        if not field.check(piece[name]):
            return name, piece[name], field.expected
    return None

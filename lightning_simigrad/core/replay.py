r"""Learn once, replay: a fixed batch-size schedule from a finished SimiGrad run.

A run's trajectory is, per optimizer step, the weight trained after the step (``samples_seen``; ``tokens_seen``
where batches count tokens) and the step's batch size, as ``SimiGrad.history`` and the recipes'
``simigrad_trace.csv`` hold them. :func:`replay_steps` turns it into steps ``{weight trained before the step: batch
size}``, the dict a :class:`~lightning_simigrad.core.batch_schedules.BatchSchedule` takes: replayed with the same
data and seed, every window is planned as the run planned it, its epochs' tails included.

>>> seen, sizes = [16, 32, 50, 70, 92, 118, 150], [16, 16, 18, 20, 22, 26, 32]
>>> replay_steps(seen, sizes)
{0: 16, 32: 18, 50: 20, 70: 22, 92: 26, 118: 32}

Smoothing takes each step's median over ``smooth`` steps centred on it; the epoch tails' short steps (9 and 12
here) and single-step swings go, and each size is one the run trained:

>>> sizes = [16, 18, 9, 20, 22, 24, 12, 26]
>>> replay_steps([16, 34, 43, 63, 85, 109, 121, 147], sizes, smooth=3)
{0: 16, 34: 18, 43: 20, 63: 22, 109: 24, 121: 26}

Snapping gives integer-factor steps from the first size (16, 32, 64, ...), a level changing where the trajectory
crosses the geometric midpoint of two levels (16 x 2^(1/2) = 22.6, 45.3, 90.5); a raw trajectory that dips back
under a midpoint dips a level (22 at 59), which smoothing first removes:

>>> seen, sizes = [16, 36, 59, 81, 111, 156, 202, 262, 357], [16, 20, 23, 22, 30, 45, 46, 60, 95]
>>> replay_steps(seen, sizes, snap="doubling")
{0: 16, 36: 32, 59: 16, 81: 32, 156: 64, 262: 128}
>>> replay_steps(seen, sizes, smooth=3, snap="doubling")
{0: 16, 59: 32, 156: 64, 262: 128}
>>> replay_steps([40, 56], [24, 16])
Traceback (most recent call last):
...
ValueError: the trajectory starts after 16 samples trained (step 0, of 24 samples, ends at 40): ...
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_simigrad.core.batch_schedules import BatchSchedule

__all__ = ["SNAPS", "TRACE_NAME", "Trajectory", "read_schedule", "read_trace", "recorded_schedule", "replay_steps"]

SNAPS = ("doubling",)
TRACE_NAME = "simigrad_trace.csv"  # what the recipes write in a run's directory
_COUNTS = {"samples": "samples_seen", "tokens": "tokens_seen"}  # the unit's running count, per step
_NEEDED = ("batch_size", *_COUNTS.values())
_PREFIX = "simigrad/"  # the loggers' (and a W&B export's) names of the history's keys


@dataclass(frozen=True)
class Trajectory:
    """A run's steps: the weight trained after each (``seen``), its batch size, in ``unit``; ``labels`` name each
    step's row in messages."""

    unit: str
    seen: tuple[int, ...]
    sizes: tuple[int, ...]
    labels: tuple[str, ...]

    @classmethod
    def of_rows(cls, rows: Sequence[Mapping[str, Any]], source: str, labels: Sequence[str] = ()) -> Trajectory:
        """The trajectory in ``rows`` (``SimiGrad.history``'s, or :func:`read_trace`'s): in tokens where they have
        ``tokens_seen``, else in samples; ``source`` names them in messages."""
        if not rows:
            raise ValueError(f"{source} holds no steps: replay the history or trace of a fit that trained.")
        columns = sorted({key for row in rows for key in row})
        unit = "tokens" if "tokens_seen" in columns else "samples"
        for key in ("batch_size", _COUNTS[unit]):
            if key not in columns:
                raise ValueError(
                    f"{source} has no `{key}` column (it has {', '.join(columns)}): replay SimiGrad's history, a"
                    f" recipe's {TRACE_NAME}, or a W&B export with the `simigrad/{key}` column."
                )
        labels = tuple(labels) or tuple(f"row {i}" for i in range(len(rows)))
        seen, sizes = [], []
        for label, row in zip(labels, rows):
            seen.append(_whole(row.get(_COUNTS[unit]), f"{source}, {label}: `{_COUNTS[unit]}`"))
            sizes.append(_whole(row.get("batch_size"), f"{source}, {label}: `batch_size`"))
        return cls(unit, tuple(seen), tuple(sizes), labels)


def replay_steps(
    seen: Sequence[int],
    sizes: Sequence[int],
    smooth: int | None = None,
    snap: str | None = None,
    base: int | None = None,
    unit: str = "samples",
    labels: Sequence[str] = (),
) -> dict[int, int]:
    """Steps ``{weight trained before the step: batch size}`` that replay a run's trajectory.

    Args:
        seen: per step, the weight trained after it (samples, or tokens), increasing; the first step starts at 0.
        sizes: per step, its batch size; a step starts at ``seen - size``. Rows may be missing (a sampled export):
            the size before a gap holds until the next row.
        smooth: an odd number of steps: each step takes the median size of the ``smooth`` steps centred on it
            (fewer at the ends, centred still, so the first and last steps keep their sizes). A median rather than a
            mean or geometric mean: the paper's rule moves the batch x1.1 / x0.9 a step, a multiplicative walk
            around the batch its target asks for; its median follows that level, is the same taken over B or over
            log B, drops single-step swings and the epochs' tails (one or two steps of about half a batch, over a
            window of 5 or more) entirely where a mean dips with them, and is always a size the run trained.
            ``None`` or 1: the sizes as recorded.
        snap: ``"doubling"``: each (smoothed) size becomes the nearest level ``base x 2^k`` in log scale (k >= 0:
            never below ``base``), so the schedule changes by integer factors, where the trajectory crosses the
            geometric midpoint ``base x 2^(k + 1/2)`` of two levels.
        base: the first level of ``snap`` (default: the first step's size).
        unit: what ``seen`` and ``sizes`` count, for messages.
        labels: each step's name in messages (default ``step i``).

    Raises:
        ValueError: for options outside these, and for a trajectory that is empty, does not start at 0, or whose
            counts do not increase by at least each step's size.
    """
    if smooth is not None and (
        isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 1 or smooth % 2 == 0
    ):
        raise ValueError(f"`smooth` = {smooth!r}: the steps of the median's window, an odd positive int (e.g. 5).")
    if snap is not None and snap not in SNAPS:
        raise ValueError(f"`snap` = {snap!r}: one of {', '.join(map(repr, SNAPS))}, or None for no snapping.")
    if base is not None and (isinstance(base, bool) or not isinstance(base, int) or base <= 0):
        raise ValueError(f"`base` = {base!r}: the first level of the doublings, a positive int.")
    labels = tuple(labels) or tuple(f"step {i}" for i in range(len(sizes)))
    if len(seen) != len(sizes) or not sizes:
        raise ValueError(f"a trajectory of {len(seen)} counts and {len(sizes)} batch sizes: one of each per step.")
    for label, size in zip(labels, sizes):
        if size <= 0:
            raise ValueError(f"{label}: a batch of {size} {unit}: a batch size must be a positive int.")
    before = [count - size for count, size in zip(seen, sizes)]
    if before[0] < 0:
        raise ValueError(
            f"{labels[0]}: a batch of {sizes[0]} {unit} but {seen[0]} {unit} trained after it: the batch sizes and"
            " the counts are not one run's."
        )
    if before[0] > 0:
        raise ValueError(
            f"the trajectory starts after {before[0]} {unit} trained ({labels[0]}, of {sizes[0]} {unit}, ends at"
            f" {seen[0]}): a replay starts at the fit's first step. Record from the fit's start (not a resumed fit's)"
            " with `SimiGrad(history_size=None)`, whose history otherwise keeps only the latest 10,000 steps."
        )
    for i in range(1, len(sizes)):
        if before[i] < seen[i - 1]:
            raise ValueError(
                f"{labels[i]} ends at {seen[i]} {unit} trained with a batch of {sizes[i]}, so it starts before"
                f" {labels[i - 1]} ends ({seen[i - 1]}): the counts must increase by each step's batch, in the order"
                " trained. Is the file sorted, and from one run?"
            )
    levels = list(sizes)
    if smooth is not None and smooth > 1:
        half = smooth // 2
        for i in range(len(levels)):
            h = min(half, i, len(sizes) - 1 - i)  # shrunk at the ends, centred still
            levels[i] = sorted(sizes[i - h : i + h + 1])[h]
    if snap == "doubling":
        levels = [_doubling(size, base or sizes[0]) for size in levels]
    steps: dict[int, int] = {}
    held = None
    for start, size in zip(before, levels):
        if size != held:  # a size holds until the next change
            steps[start] = held = size
    return steps


def _doubling(size: int, base: int) -> int:
    """The level ``base x 2^k`` (k >= 0) nearest ``size`` in log scale: the next level up once ``size`` reaches the
    midpoint, ``size^2 >= 2 level^2`` (integers: no rounding; it is never equal, 2 having no rational root)."""
    level = base
    while size * size >= 2 * level * level:
        level *= 2
    return level


def recorded_schedule(steps: Mapping[int, int], describe: str) -> BatchSchedule:
    """The :class:`BatchSchedule` of ``steps`` from a recorded run, whose sizes are asked for as they are."""
    schedule = BatchSchedule.of(dict(steps))
    schedule.describe, schedule.recorded = describe, True
    return schedule


def read_trace(path: str | Path) -> tuple[list[dict[str, float]], list[str]]:
    """The numeric cells of a trace CSV, one dict per step, and each row's line (``"line 7"``): a recipe's
    ``simigrad_trace.csv`` (or the run directory holding it), or a W&B export whose ``simigrad/*`` columns are
    kept without the prefix. Rows without a batch size and a count (other metrics' rows) are left out.

    Raises:
        FileNotFoundError: no such file. ValueError: not a CSV with a header, or a needed cell not a number.
    """
    path = Path(path)
    if path.is_dir() and (path / TRACE_NAME).is_file():
        path = path / TRACE_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"`path` = '{path}' is not a file: pass the {TRACE_NAME} a recipe wrote in its run directory, or a CSV"
            " exported from W&B."
        )
    try:
        with path.open(newline="") as file:
            reader = csv.DictReader(file)
            header = list(reader.fieldnames or [])
            if not any(name in header or _PREFIX + name in header for name in _NEEDED):
                raise ValueError(
                    f"'{path}' has no `batch_size`, `samples_seen` or `tokens_seen` column (its first line: "
                    f"{','.join(header)[:120]!r}): pass a recipe's {TRACE_NAME} or a W&B export of `simigrad/*`."
                )
            prefixed = any(name.startswith(_PREFIX) for name in header)
            rows, lines = [], []
            for raw in reader:
                row = {}
                for name, cell in raw.items():
                    if name is None or (prefixed and not name.startswith(_PREFIX)):
                        continue  # cells past the header, and a W&B export's other metrics
                    key = name.removeprefix(_PREFIX)
                    if isinstance(cell, str) and cell.strip():
                        try:
                            row[key] = float(cell)
                        except ValueError:
                            if key in _NEEDED:
                                raise ValueError(
                                    f"'{path}', line {reader.line_num}: `{key}` = {cell!r} is not a number."
                                ) from None
                if any(key in row for key in _NEEDED):
                    rows.append(row)
                    lines.append(f"line {reader.line_num}")
    except UnicodeDecodeError as error:
        raise ValueError(f"'{path}' is not a text CSV ({error.reason}): pass a {TRACE_NAME}.") from None
    return rows, lines


def read_schedule(path: str | Path) -> tuple[str, dict[int, int]]:
    """The unit and steps of a schedule YAML written by ``simigrad-trace --schedule``."""
    import yaml  # Lightning's own dependency

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"`path` = '{path}' is not a file: pass a schedule YAML written by simigrad-trace.")
    try:
        content = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"'{path}' is not YAML ({type(error).__name__}): pass one simigrad-trace wrote.") from None
    if not isinstance(content, dict) or not isinstance(content.get("schedule"), dict):
        raise ValueError(
            f"'{path}' has no `schedule:` mapping {{trained: batch size}}: pass a YAML written by `simigrad-trace"
            " TRACE.csv --schedule out.yaml`."
        )
    unit = content.get("unit", "samples")
    if unit not in _COUNTS:
        raise ValueError(f"'{path}': `unit` = {unit!r}: one of {', '.join(_COUNTS)}.")
    return unit, dict(content["schedule"])


def _whole(value: Any, where: str) -> int:
    """``value`` as a non-negative int (a logged count is a float)."""
    if value is None:
        raise ValueError(f"{where} is empty: every step needs its batch size and its count.")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where} = {value!r}: a count of samples or tokens, a non-negative whole number.")
    if value != int(value):
        raise ValueError(f"{where} = {value!r} is not a whole number: a count of samples or tokens.")
    return int(value)

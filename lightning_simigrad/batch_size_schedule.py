"""BatchSizeSchedule: a fixed batch-size schedule (a ramp, doublings, steps), trained with SimiGrad's machinery.

The callback is :class:`~lightning_simigrad.SimiGrad` with the controller's decisions replaced by a schedule known
ahead (:mod:`lightning_simigrad.core.batch_schedules`): the same exact windows (every step the mean over exactly
its samples, each sample once per epoch, under DDP and FSDP), the same learning-rate coupling, step-based settings
counted in samples, checkpoints and logging. It still measures the two halves' similarity and the noise scale
every step and logs them, without acting on them. Because the schedule is known ahead, the windows a DataLoader
plans ahead of training follow it exactly: every step's size is what the schedule gives for the samples trained
before it (the epoch's last two windows share what is left, as with SimiGrad).

:meth:`BatchSizeSchedule.from_history` and :meth:`BatchSizeSchedule.from_trace` replay a finished SimiGrad run's
batch sizes (:mod:`lightning_simigrad.core.replay`): learn the trajectory once, train later runs on it with no
controller, step for step the same windows on the same data and seed.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_simigrad.callback import SimiGrad
from lightning_simigrad.core.batch_schedules import BatchSchedule
from lightning_simigrad.core.replay import Trajectory, read_schedule, read_trace, recorded_schedule, replay_steps
from lightning_simigrad.core.settings import BatchSettings, Settings

__all__ = ["BatchSizeSchedule"]


class BatchSizeSchedule(SimiGrad):
    """Train with a fixed global batch-size schedule instead of an adaptive one.

    Args:
        schedule: ``schedule(trained)`` gives the global batch size of the step after ``trained`` samples; or a
            dict ``{samples trained: batch size}`` of steps (it must hold the key 0); or
            :func:`~lightning_simigrad.linear_ramp` / :func:`~lightning_simigrad.doubling`; or a finished run's
            batch sizes, replayed: :meth:`from_history`, :meth:`from_trace`.
        initial_batch_size: B0, the batch the configured learning rate belongs to (default: the schedule's first
            size, ``schedule(0)``): with ``lr_scaling="sqrt"`` (the default) the learning rate follows
            ``sqrt(B / B0)`` along the ramp; ``lr_scaling="none"`` keeps it as your scheduler sets it.
        **arguments: :class:`~lightning_simigrad.SimiGrad`'s arguments that apply to any batch: ``min_batch_size``,
            ``max_batch_size`` (the schedule is refused if it leaves them at its first size or at a step of a dict;
            a replay refuses them),
            ``max_micro_batch_size``, ``lr_scaling``, ``lr_scaling_blend``, ``schedule_by_samples``,
            ``max_samples``, ``progress_bar``, ``history_size``, ``loss_items``.

    Raises:
        ValueError: at construction, for a schedule that is not a function or a dict, gives a size that is not a
            positive int, or leaves the bounds, and for bounds with a replay; during the fit, for a function that later
            gives such a size.

    Example::

        from lightning_simigrad import BatchSizeSchedule, linear_ramp

        ramp = BatchSizeSchedule(linear_ramp(start=256, end=4096, over=2_000_000), max_micro_batch_size=128)
        trainer = L.Trainer(callbacks=[ramp])
    """

    # read back as attributes (`callback.max_batch_size`); the schedule is `callback.settings.schedule` (the
    # `schedule` attribute is the windows planned, as on SimiGrad)
    ARGUMENTS = frozenset(BatchSettings.__dataclass_fields__)

    def __init__(self, schedule: Any, **arguments: Any) -> None:  # noqa: D107 (documented on the class)
        unknown = sorted(set(arguments) - set(BatchSettings.__dataclass_fields__))
        if unknown:
            raise TypeError(
                f"BatchSizeSchedule() got unexpected argument(s) {', '.join(unknown)}: a schedule decides the batch,"
                " so the controller's arguments do not apply (SimiGrad takes them)."
            )
        planned = BatchSchedule.of(schedule)
        bounds = {k: arguments[k] for k in ("min_batch_size", "max_batch_size") if arguments.get(k) is not None}
        if planned.recorded and bounds:
            name, value = next(iter(bounds.items()))
            raise ValueError(
                f"`{name}` = {value} with a replay ({planned.describe}): a replay trains the recorded run's batch sizes"
                " as they are (that run's controller kept to its bounds; its epochs' last windows, which may lie below"
                f" them, are planned again alike). Leave `{name}` out."
            )
        points = list(schedule) if isinstance(schedule, dict) else []
        planned.check_bounds(arguments.get("min_batch_size"), arguments.get("max_batch_size"), points)
        if arguments.get("initial_batch_size") is None:
            arguments["initial_batch_size"] = planned(0)
        settings = Settings(None, adjust=False, schedule=planned, **arguments)  # measured and logged, never compared
        super(SimiGrad, self).__init__(settings)  # SimiGrad's own __init__ takes a target; the rest is shared

    __init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("schedule", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            *inspect.signature(BatchSettings).parameters.values(),
        ]
    )

    @classmethod
    def from_history(
        cls,
        history: Sequence[Mapping[str, Any]],
        *,
        smooth: int | None = None,
        snap: str | None = None,
        **arguments: Any,
    ) -> BatchSizeSchedule:
        """Replay the batch sizes of a finished run's ``SimiGrad.history``.

        With the same data, seed and ``max_micro_batch_size``, the replay trains every step on the windows the run
        trained (its epochs' tails included), without a controller. The unit is the run's: tokens where its history
        has ``tokens_seen`` (it ran with ``lengths``; pass the same ``lengths``), else samples.

        Args:
            history: ``SimiGrad.history`` of a fit from its first step (``history_size=None`` keeps every step).
            smooth: an odd number of steps: each step's size becomes the median over that many steps centred on it
                (:func:`~lightning_simigrad.core.replay.replay_steps`).
            snap: ``"doubling"``: sizes snapped to ``B0 x 2^k``, integer factors from B0, never below it.
            **arguments: :class:`BatchSizeSchedule`'s other arguments but the bounds (the run kept to its own);
                ``initial_batch_size`` defaults to the first step's size.

        Raises:
            ValueError: for an empty or malformed history, a unit that ``lengths`` contradicts, or bounds.

        Example::

            simigrad = SimiGrad(target_similarity=0.8, history_size=None)
            L.Trainer(callbacks=[simigrad]).fit(model, loader)
            replay = BatchSizeSchedule.from_history(simigrad.history, smooth=5, snap="doubling")
        """
        return cls._replay(Trajectory.of_rows(history, "`history`"), "`history`", smooth, snap, arguments)

    @classmethod
    def from_trace(
        cls, path: str | Path, *, smooth: int | None = None, snap: str | None = None, **arguments: Any
    ) -> BatchSizeSchedule:
        """Replay the batch sizes of a finished run's trace: a recipe's ``simigrad_trace.csv`` (or its run directory),
        a W&B export with the columns ``simigrad/batch_size`` and ``simigrad/samples_seen`` (``simigrad/tokens_seen``
        in tokens), or a schedule YAML written by ``simigrad-trace --schedule`` (replayed as written: no ``smooth``
        or ``snap``). As :meth:`from_history` otherwise.

        Raises:
            FileNotFoundError: no such file. ValueError: as :meth:`from_history`, and for a file that is not a trace.
        """
        if Path(path).suffix.lower() in (".yaml", ".yml"):
            for name, value in (("smooth", smooth), ("snap", snap)):
                if value is not None:
                    raise ValueError(
                        f"`{name}` = {value!r} with the schedule '{path}': a schedule file is replayed as written;"
                        f" give `{name}` to `simigrad-trace --schedule` with the trace it came from."
                    )
            unit, steps = read_schedule(path)
            _check_unit(unit, f"'{path}'", arguments.get("lengths"))
            return cls(recorded_schedule(steps, f"the schedule in {Path(path).name}"), **arguments)
        rows, lines = read_trace(path)
        return cls._replay(Trajectory.of_rows(rows, f"'{path}'", lines), f"'{path}'", smooth, snap, arguments)

    @classmethod
    def _replay(
        cls, trajectory: Trajectory, source: str, smooth: int | None, snap: str | None, arguments: dict[str, Any]
    ) -> BatchSizeSchedule:
        _check_unit(trajectory.unit, source, arguments.get("lengths"))
        given = arguments.get("initial_batch_size")  # one that is not a positive int is refused with the others
        base = given if isinstance(given, int) and not isinstance(given, bool) and given > 0 else None
        steps = replay_steps(trajectory.seen, trajectory.sizes, smooth, snap, base, trajectory.unit, trajectory.labels)
        # B0 is the LR's anchor and the snap's first level: the run's first step, unless the run's own B0 is given
        # (in tokens the first window holds whole sequences, within half a sequence of B0)
        arguments.setdefault("initial_batch_size", trajectory.sizes[0])
        shaped = "".join(f", {k}={v!r}" for k, v in (("smooth", smooth), ("snap", snap)) if v is not None)
        describe = f"a replay of {source}: {len(trajectory.sizes)} steps in {trajectory.unit}{shaped}"
        return cls(recorded_schedule(steps, describe), **arguments)


def _check_unit(unit: str, source: str, lengths: Any) -> None:
    """A trace in tokens needs ``lengths`` (its batch sizes are tokens); one in samples refuses them."""
    if unit == "tokens" and lengths is None:
        raise ValueError(
            f"`lengths` = None, but {source} counts tokens (it has `tokens_seen`): its batch sizes are tokens. Pass"
            " the recorded run's `lengths=` (every sample's tokens), so that the replay counts tokens too."
        )
    if unit == "samples" and lengths is not None:
        shown = f"a list of {len(lengths)} lengths" if isinstance(lengths, Sequence) else repr(lengths)
        raise ValueError(
            f"`lengths` = {shown}, but {source} counts samples (it has no `tokens_seen`): leave `lengths` out to"
            " replay it in samples, or replay a trace recorded with `lengths`."
        )

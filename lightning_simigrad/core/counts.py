"""How far a fit has come: its optimizer steps, the samples and the weight they averaged, the epoch's position.

:class:`FitCounts` is the run's progress counter, a small dataclass that saves and restores its own piece of the
checkpoint (as Lightning's loops keep their progress). Two units are counted side by side:

- *samples*, what an epoch's coverage counts (every sample once per epoch) and where the sampler stands in it;
- *weight*, what batch sizes count (:attr:`~lightning_simigrad.core.plan.Window.weight`): samples too, unless
  batches are counted in another unit.

>>> counts = FitCounts()
>>> counts.commit(samples=8, weight=8, epoch_samples=8)
(0, 8)
>>> counts.steps, counts.samples_seen, counts.epoch_samples_done, counts.state_dict()["weight_seen"]
(1, 8, 8, 8)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from lightning_simigrad.core.fields import NON_NEGATIVE_INT, POSITIVE_INT, Field, list_of, optional

__all__ = ["FitCounts", "FitFacts", "SchedulerSteps"]


@dataclass
class FitCounts:
    """The fit's counters after its last optimizer step.

    Args:
        steps: optimizer steps taken.
        samples_seen: samples those steps averaged.
        weight_seen: their weight (what batch sizes count).
        epoch_samples_done: where the sampler stands in the epoch being trained: the samples of the windows
            committed in it, skipped micro-batches' included.
    """

    steps: int = 0
    samples_seen: int = 0
    weight_seen: int = 0
    epoch_samples_done: int = 0

    STATE_FIELDS: ClassVar[dict[str, Field]] = {
        "steps": NON_NEGATIVE_INT,
        "samples_seen": NON_NEGATIVE_INT,
        "weight_seen": NON_NEGATIVE_INT,
        "epoch_samples_done": NON_NEGATIVE_INT,
    }

    def commit(self, samples: int, weight: int, epoch_samples: int) -> tuple[int, int]:
        """An optimizer step averaged ``samples`` (of ``weight``) and moved the epoch on by ``epoch_samples``;
        returns the epoch's position before and after."""
        before = self.epoch_samples_done
        self.steps += 1
        self.samples_seen += samples
        self.weight_seen += weight
        self.epoch_samples_done += epoch_samples
        return before, self.epoch_samples_done

    def start_epoch(self, samples_done: int = 0) -> None:
        """An epoch starts, at ``samples_done`` (a resumed epoch's committed samples)."""
        self.epoch_samples_done = samples_done

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.STATE_FIELDS:
            setattr(self, name, int(state[name]))

    @classmethod
    def of(cls, state: dict[str, Any]) -> FitCounts:
        """The counts a checkpoint's piece holds."""
        counts = cls()
        counts.load_state_dict(state)
        return counts


@dataclass(frozen=True)
class FitFacts:
    """What a fit was set up with, that a resume must agree with or take over.

    Args:
        initial_batch_size: B0, the batch the learning rate belongs to (a resumed fit keeps the checkpoint's).
        world_size: data-parallel ranks.
        epoch_length: samples in an epoch's order (None: unknown, a stream).
    """

    initial_batch_size: int
    world_size: int
    epoch_length: int | None

    STATE_FIELDS: ClassVar[dict[str, Field]] = {
        "initial_batch_size": POSITIVE_INT,
        "world_size": POSITIVE_INT,
        "epoch_length": optional(NON_NEGATIVE_INT),
    }

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, state: dict[str, Any]) -> FitFacts:
        """The facts a checkpoint's piece holds (a resumed fit takes B0 over from them)."""
        length = state["epoch_length"]
        return cls(int(state["initial_batch_size"]), int(state["world_size"]), None if length is None else int(length))


@dataclass
class SchedulerSteps:
    """Steps each step-interval LR scheduler has taken, by its index in ``trainer.lr_scheduler_configs``, when they
    are counted in B0-steps of samples (:mod:`lightning_simigrad.integration.sample_schedules`).

    >>> steps = SchedulerSteps()
    >>> steps.load_state_dict({"scheduler_steps": [3, 1]}); steps.state_dict()
    {'scheduler_steps': [3, 1]}
    """

    steps: list[int] = field(default_factory=list)

    STATE_FIELDS: ClassVar[dict[str, Field]] = {
        "scheduler_steps": list_of(NON_NEGATIVE_INT, "a list of non-negative ints"),
    }

    def cover(self, schedulers: int) -> None:
        """Count ``schedulers`` schedulers (those not counted yet have taken none)."""
        self.steps += [0] * (schedulers - len(self.steps))

    def taken(self, index: int) -> int:
        """Steps scheduler ``index`` has taken (0 for one not counted yet)."""
        return self.steps[index] if index < len(self.steps) else 0

    def set(self, index: int, steps: int) -> None:
        """Scheduler ``index`` has taken ``steps`` steps."""
        self.steps += [0] * (index + 1 - len(self.steps))
        self.steps[index] = steps

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler_steps": list(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = [int(n) for n in state.get("scheduler_steps", [])]

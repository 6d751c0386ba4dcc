"""The arguments of the adaptive-batch callbacks, declared once: names, types, defaults and their checks.

:class:`Settings` is what :class:`~lightning_simigrad.SimiGrad` takes: the arguments every adaptive batch shares
(:class:`BatchSettings`: bounds, micro-batch cap, B0, learning-rate coupling, counts in samples, the fit's budget,
display) and the controller's. The callback's signature is this dataclass's, and a fit reads a frozen copy made
when it starts. They are validated when the callback is made, before any Trainer exists.

>>> Settings(target_similarity=0.8).controller_args(initial_batch_size=64, min_batch_size=2)["min_batch_size"]
2
>>> Settings(target_similarity=0.8, lr_scaling="cubic")
Traceback (most recent call last):
...
ValueError: `lr_scaling` must be one of ('sqrt', 'linear', 'none'), got 'cubic'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from lightning_simigrad.core.batch_schedules import BatchSchedule
from lightning_simigrad.core.controller import BatchSizeController
from lightning_simigrad.core.lr_scaling import LR_SCALINGS
from lightning_simigrad.core.units import Unit, unit_of
from lightning_simigrad.core.world import Elastic

__all__ = ["BatchSettings", "Settings"]


@dataclass(frozen=True, kw_only=True)
class BatchSettings:
    """What every adaptive batch takes, whatever decides its size (see :class:`~lightning_simigrad.SimiGrad`)."""

    min_batch_size: int | None = None  # smallest global batch (default: what a measurement needs)
    max_batch_size: int | None = None  # largest global batch (default: unbounded)
    max_micro_batch_size: int | None = None  # most samples per device in one forward/backward (default: the loader's)
    initial_batch_size: int | None = None  # B0 (default: the loader's batch x world size x accumulation)
    lr_scaling: str = "sqrt"  # "sqrt", "linear" or "none": the learning rate follows the batch
    lr_scaling_blend: float = 1.0  # (factor - 1) f + 1
    schedule_by_samples: bool = True  # schedulers, max_steps and the step estimate count steps of B0 samples
    max_samples: int | None = None  # end the fit after exactly this many samples
    progress_bar: bool = True  # the batch, similarity and noise scale in the progress bar's postfix
    history_size: int | None = 10_000  # steps `history` keeps (None: all, 0: none)
    # batch -> its number of loss items (labelled tokens): every item of a step then weighs 1 / (the step's items)
    loss_items: Callable[[Any], Any] | None = None
    # each sample's tokens (one int per sample, or a function of a sample): batch sizes then count tokens
    lengths: Sequence[int] | Callable[[Any], Any] | None = None
    max_micro_batch_tokens: int | None = None  # most padded tokens per device in one forward/backward (with `lengths`)
    unit: Unit | None = None  # what batch sizes count, a weight of each sample's own (default: samples, or `lengths`)
    elastic: Elastic | None = None  # the world size the batch wants, logged and asked for (default: not watched)

    def __post_init__(self) -> None:
        if self.lr_scaling not in LR_SCALINGS:
            raise ValueError(f"`lr_scaling` must be one of {LR_SCALINGS}, got {self.lr_scaling!r}.")
        blend = self.lr_scaling_blend
        if not (isinstance(blend, (int, float)) and 0.0 <= blend <= 1.0):
            raise ValueError(f"`lr_scaling_blend` must lie in [0, 1], got {blend!r}. Use 1 for the full factor.")
        for name in ("max_micro_batch_size", "initial_batch_size", "max_samples", "max_micro_batch_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"`{name}` must be a positive int or None, got {value!r}.")
        if self.loss_items is not None and not callable(self.loss_items):
            raise ValueError(
                f"`loss_items` must be a function of a micro-batch returning its number of loss items, got"
                f" {self.loss_items!r}. For example `loss_items=lambda batch: (batch['labels'] != -100).sum()`."
            )
        self._check_unit()
        if self.elastic is not None and not isinstance(self.elastic, Elastic):
            raise ValueError(
                f"`elastic` must be a `lightning_simigrad.Elastic`, got {self.elastic!r}. For example"
                " `elastic=Elastic(max_accumulation=8, devices_per_node=8, max_nodes=16)`."
            )
        size = self.history_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise ValueError(
                f"`history_size` must be a non-negative int or None, got {size!r}. Use None to keep every"
                " step, 0 to keep none."
            )

    def _check_unit(self) -> None:
        if self.unit is not None and not isinstance(self.unit, Unit):
            raise ValueError(
                f"`unit` must be a `lightning_simigrad.Unit`, got {self.unit!r}. For example"
                " `unit=Unit('pixels', per_sample=[h * w for h, w in sizes])`."
            )
        unit = self.batch_unit  # checks its own arguments
        if unit.weighted and self.initial_batch_size is None:
            raise ValueError(
                f"With `{unit.setting}`, batch sizes count {unit.name}: give `initial_batch_size` (B0) in"
                f" {unit.name}, the {unit.name} per step the learning rate was set for (e.g. `initial_batch_size=16 *"
                " 512` for 16 sequences of 512 tokens)."
            )

    @cached_property
    def batch_unit(self) -> Unit:
        """What batch sizes count: the one unit ``unit``, ``lengths``, ``max_micro_batch_tokens`` and ``loss_items``
        describe (:func:`~lightning_simigrad.core.units.unit_of`)."""
        return unit_of(self.unit, self.lengths, self.max_micro_batch_tokens, self.loss_items)


@dataclass(frozen=True, kw_only=True)
class Settings(BatchSettings):
    """The arguments of :class:`~lightning_simigrad.SimiGrad` (documented there)."""

    # None only where a fixed schedule decides the batch (BatchSizeSchedule): nothing is compared with a target then
    target_similarity: float | None = field(kw_only=False)
    adjust: bool = True  # False: measure and log, never change the batch
    controller: str = "paper"  # "paper" (x grow / x shrink), "noise_scale" (jump to B*) or "ratchet" (grow towards B*)
    grow_factor: float = 1.1
    shrink_factor: float = 0.9
    smoothing: float = 0.0  # EMA decay of the similarity the paper rule compares
    noise_scale_decay: float = 0.9  # EMA decay of the noise scale's numerator and denominator
    deadband: float = 0.0  # hold while the similarity is this close to the target
    warmup_steps: int = 0  # measured steps before the first change
    # a fixed schedule decides the batch instead of the controller (BatchSizeSchedule; not an argument of SimiGrad)
    schedule: BatchSchedule | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target_similarity is None and (self.schedule is None or self.adjust):
            raise ValueError(
                "`target_similarity` is None: SimiGrad holds the similarity at a target in (-1, 1); give one (the"
                " paper uses 0.8 for BERT, 0.2 for ResNet-18), or use `BatchSizeSchedule` for a fixed schedule."
            )
        # the controller checks its own arguments
        BatchSizeController(**self.controller_args(self.initial_batch_size or self.min_batch_size or 1))

    def controller_args(self, initial_batch_size: int, min_batch_size: int | None = None) -> dict[str, Any]:
        """The :class:`BatchSizeController` arguments, with B0 and the smallest batch a measurement needs."""
        args = {name: getattr(self, name) for name in _CONTROLLER_ARGS}
        args["rule"] = self.controller
        args["counts_tokens"] = self.batch_unit.weighted  # B* counts samples; the batch, the unit's weight
        if min_batch_size is not None:
            args["min_batch_size"] = max(args["min_batch_size"] or 1, min_batch_size)
        return {"initial_batch_size": initial_batch_size, **args}


_CONTROLLER_ARGS = (
    "target_similarity",
    "min_batch_size",
    "max_batch_size",
    "grow_factor",
    "shrink_factor",
    "smoothing",
    "noise_scale_decay",
    "deadband",
    "warmup_steps",
)

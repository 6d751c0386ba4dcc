"""What a batch size counts: the unit of weight, one object.

Every sample of the training data carries a *weight*, what batch sizes count: 1 where batches count samples, its
tokens where they count tokens (``SimiGrad(lengths=...)``), or a weight of the user's own
(``SimiGrad(unit=Unit("pixels", per_sample=...))``). A :class:`Unit` says, for a fit:

- each sample's weight (:attr:`Unit.per_sample`: one int per sample of the dataset, or a function of a sample; None
  where every sample weighs 1), read once per dataset when the training data arrives
  (:mod:`lightning_simigrad.data.weights`);
- how a window's samples are cut into slots on the ranks (:meth:`Unit.cut`): as equal counts of samples
  (:func:`~lightning_simigrad.core.plan.plan_window`), or by their weights, alike on every rank and within
  :attr:`Unit.max_slot_weight` after padding (:func:`~lightning_simigrad.core.token_plan.plan_token_window`);
- how a micro-batch's loss is weighed: by its samples, or, given ``loss_items``, by the loss items it holds
  (:mod:`lightning_simigrad.weighing`).

Windows, counts, the budget (``max_samples``, ``max_steps`` in B0-steps), the learning-rate factor, the bounds,
reporting and the progress bar all count a window's *weight* (:attr:`~lightning_simigrad.core.plan.Window.weight`)
and never ask which unit it is; what covers an epoch and feeds BatchNorm stays samples. :func:`unit_of` builds the
unit from the callback's settings: it is the one place a unit is chosen.

>>> tokens = Unit("tokens", per_sample=[5, 3, 2, 6], max_slot_weight=8, setting="lengths")
>>> tokens.weighted, Unit().weighted
(True, False)
>>> from lightning_simigrad.core.plan import plan_window
>>> by_count = plan_window(4, 4, world_size=1, max_micro_batch_size=8, min_micro_batches=2, even_micro_batches=True)
>>> by_count.sizes, tokens.cut(by_count, [5, 3, 2, 6], 1, 8, 2, True).sizes
(((2,), (2,)), ((1,), (1,), (1,), (1,)))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_simigrad.core.plan import Window
from lightning_simigrad.core.token_plan import plan_token_window

__all__ = ["Unit", "unit_of"]


@dataclass(frozen=True)
class Unit:
    """What batch sizes count (see the module docstring).

    Args:
        name: the unit, in messages and metric names (``simigrad/<name>_seen``): ``"samples"``, ``"tokens"``, ...
        per_sample: each sample's weight: one positive int per sample of the training dataset, in its index order, or
            a function of a sample (read once per dataset, in the main process); None: every sample weighs 1.
        max_slot_weight: most weight a micro-batch may hold on one device after padding to its heaviest sample
            (``n x max``, the memory bound of padded sequences); None: only ``max_micro_batch_size`` bounds it.
        loss_items: ``fn(batch)``, a micro-batch's loss items, where ``training_step`` returns the mean loss over them
            (every item of a step then weighs alike); None: every sample of a step weighs alike.
        setting: the argument that gave ``per_sample``, for messages.
    """

    name: str = "samples"
    per_sample: Sequence[int] | Callable[[Any], Any] | None = None
    max_slot_weight: int | None = None
    loss_items: Callable[[Any], Any] | None = None
    setting: str = "unit"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"A unit's `name` names metrics (`simigrad/<name>_seen`): a word, got {self.name!r}.")
        per_sample = self.per_sample
        if per_sample is not None and (
            isinstance(per_sample, (str, bytes)) or not (callable(per_sample) or hasattr(per_sample, "__len__"))
        ):
            raise ValueError(
                f"`{self.setting}` must be one int per sample of the training dataset, or a function of a sample"
                f" returning its weight, got {per_sample!r}. For example `lengths=lambda sample:"
                " len(sample['input_ids'])`."
            )
        cap = self.max_slot_weight
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ValueError(f"`max_micro_batch_tokens` must be a positive int or None, got {cap!r}.")
        if cap is not None and per_sample is None:
            raise ValueError(
                f"`max_micro_batch_tokens={cap}` bounds micro-batches in tokens, which needs every sample's tokens:"
                " give `lengths` too (one int per sample, or a function of a sample), or bound micro-batches in"
                " samples with `max_micro_batch_size`."
            )

    @property
    def weighted(self) -> bool:
        """Samples weigh unalike: batch sizes count their weights, not the samples."""
        return self.per_sample is not None

    def cut(
        self,
        window: Window,
        weights: Sequence[int] | None,
        world_size: int,
        max_micro_batch_size: int,
        min_micro_batches: int,
        even: bool,
    ) -> Window:
        """The slots of a window whose samples the planner chose (``window``, planned by their count, with the epoch's
        tail rules of :func:`~lightning_simigrad.core.plan.plan_window`): that plan, where every sample weighs 1;
        else the same samples, of these ``weights``, cut by weight
        (:func:`~lightning_simigrad.core.token_plan.plan_token_window`)."""
        if weights is None:
            return window
        return plan_token_window(
            weights, world_size, self.max_slot_weight, max_micro_batch_size, min_micro_batches, even
        )


def unit_of(
    unit: Unit | None,
    lengths: Sequence[int] | Callable[[Any], Any] | None,
    max_micro_batch_tokens: int | None,
    loss_items: Callable[[Any], Any] | None,
) -> Unit:
    """The unit the callback's arguments describe: ``unit``, or tokens where ``lengths`` gives each sample's, else
    samples; weighed by ``loss_items`` where given.

    >>> unit_of(None, [3, 4], 64, None).name, unit_of(None, None, None, len).loss_items is len
    ('tokens', True)
    >>> unit_of(Unit("pixels", per_sample=[9, 16]), [3, 4], None, None)
    Traceback (most recent call last):
    ...
    ValueError: Give `unit` or `lengths`, not both: `lengths` is the unit of tokens, Unit('tokens', per_sample=lengths).
    """
    if unit is not None and lengths is not None:
        raise ValueError(
            "Give `unit` or `lengths`, not both: `lengths` is the unit of tokens, Unit('tokens', per_sample=lengths)."
        )
    if unit is None:
        unit = (
            Unit()
            if lengths is None and max_micro_batch_tokens is None
            else Unit("tokens", lengths, max_micro_batch_tokens, setting="lengths")
        )
    elif max_micro_batch_tokens is not None:
        unit = replace(unit, max_slot_weight=max_micro_batch_tokens)
    if loss_items is not None:
        unit = replace(unit, loss_items=loss_items)
    return unit

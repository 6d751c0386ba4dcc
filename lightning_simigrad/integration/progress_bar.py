"""SimiGrad's numbers in Lightning's own training progress bars.

``TQDMProgressBar`` and ``RichProgressBar`` (and subclasses) show, beside Lightning's own metrics, the global
batch of the current step, the last measured similarity and the noise scale, formatted to a fixed width so the
bar does not jitter (:func:`postfix_fields`). The bars' totals, the epoch's length in micro-batches, are
:mod:`~lightning_simigrad.integration.epoch_length`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

__all__ = ["BarPostfix", "postfix_fields"]


class _Padded(str):
    """A string tqdm's ``set_postfix`` does not strip (it strips every value): the padding keeps its width."""

    def strip(self, chars: str | None = None) -> str:
        return str(self)


def postfix_fields(batch_size: int, width: int, similarity: float, noise_scale: float) -> dict[str, str]:
    """SimiGrad's postfix, each value right-aligned in a width that does not change during the fit.

    >>> postfix_fields(96, 4, 0.4567, 1234.5)
    {'batch': '  96', 'sim': ' 0.46', 'B_noise': '1.23e+03'}
    >>> postfix_fields(1024, 4, math.nan, math.nan)
    {'batch': '1024', 'sim': '    -', 'B_noise': '       -'}
    """
    fields = {
        "batch": f"{batch_size:>{width}d}",
        "sim": f"{similarity:>5.2f}" if math.isfinite(similarity) else f"{'-':>5}",
        "B_noise": f"{noise_scale:>8.3g}" if math.isfinite(noise_scale) else f"{'-':>8}",
    }
    return {key: _Padded(value) for key, value in fields.items()}


class BarPostfix:
    """Adds SimiGrad's postfix to the fit's progress bar.

    Args:
        fields: returns the postfix entries to add (see :func:`postfix_fields`), or None to add nothing.
    """

    def __init__(self, fields: Callable[[], dict[str, str] | None]) -> None:
        self._fields = fields
        self._bar: pl.Callback | None = None

    def attach(self, trainer: pl.Trainer) -> None:
        bar = trainer.progress_bar_callback
        if not isinstance(bar, (TQDMProgressBar, RichProgressBar)) or "get_metrics" in bar.__dict__:
            return
        get_metrics = bar.get_metrics

        def get_metrics_with_simigrad(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
            items = get_metrics(trainer, pl_module)
            fields = self._fields() if trainer.training else None
            return {**items, **fields} if fields else items

        bar.get_metrics = get_metrics_with_simigrad  # type: ignore[method-assign]
        self._bar = bar

    def detach(self) -> None:
        if self._bar is not None:
            self._bar.__dict__.pop("get_metrics", None)
            self._bar = None

"""Measurements of the two half-batch gradients: what the halves are, composed with how their products cross ranks.

:mod:`.protocol` says what a measurement does; :mod:`.factory` picks the one a strategy needs.
"""

from lightning_simigrad.measurement.composed import ComposedMeasurement, MeasurementSkipped, halves_of
from lightning_simigrad.measurement.factory import (
    Parallelism,
    Training,
    measurement_for,
    midpoint_reduction,
    sharded_halves,
    window_halves,
)
from lightning_simigrad.measurement.protocol import Attachment, Measurement, MeasurementError, loss_scale_of
from lightning_simigrad.measurement.rank_groups import RankGroupMeasurement

__all__ = [
    "Attachment",
    "ComposedMeasurement",
    "Measurement",
    "MeasurementError",
    "MeasurementSkipped",
    "Parallelism",
    "RankGroupMeasurement",
    "Training",
    "halves_of",
    "loss_scale_of",
    "measurement_for",
    "midpoint_reduction",
    "sharded_halves",
    "window_halves",
]

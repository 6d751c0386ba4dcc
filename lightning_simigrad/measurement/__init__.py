"""Measurements of the two half-batch gradients, one per way of training (see :mod:`.protocol`)."""

from lightning_simigrad.measurement.midpoint_reduction import MidpointReductionMeasurement
from lightning_simigrad.measurement.protocol import Measurement, MeasurementError, loss_scale_of
from lightning_simigrad.measurement.rank_groups import MeasurementSkipped, RankGroupMeasurement
from lightning_simigrad.measurement.sharded_halves import ShardedHalvesMeasurement
from lightning_simigrad.measurement.two_stage_reduce_scatter import TwoStageReduceScatterMeasurement
from lightning_simigrad.measurement.window_halves import WindowHalvesMeasurement

__all__ = [
    "Measurement",
    "MeasurementError",
    "MeasurementSkipped",
    "MidpointReductionMeasurement",
    "RankGroupMeasurement",
    "ShardedHalvesMeasurement",
    "TwoStageReduceScatterMeasurement",
    "WindowHalvesMeasurement",
    "loss_scale_of",
]

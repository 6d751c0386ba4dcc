"""Adaptive batch size training for PyTorch Lightning, after SimiGrad (Qin et al., NeurIPS 2021).

The layers, from the inside out (``docs/architecture.md``): :mod:`~lightning_simigrad.core` (pure arithmetic),
:mod:`~lightning_simigrad.measurement`, :mod:`~lightning_simigrad.data`, :mod:`~lightning_simigrad.state`,
:mod:`~lightning_simigrad.run` (one fit, without Lightning) and :mod:`~lightning_simigrad.integration` with the
:class:`SimiGrad` callback (Lightning). Importing the package changes nothing in Lightning or torch.
"""

import importlib.metadata

from lightning_simigrad.batch_size_schedule import BatchSizeSchedule
from lightning_simigrad.callback import METRICS, SimiGrad
from lightning_simigrad.core.batch_schedules import BatchSchedule, doubling, linear_ramp
from lightning_simigrad.core.controller import BatchSizeController
from lightning_simigrad.core.lr_scaling import lr_factor
from lightning_simigrad.core.plan import Window, plan_window
from lightning_simigrad.core.statistics import HalfStats, equilibrium_batch_size, expected_similarity
from lightning_simigrad.core.units import Unit
from lightning_simigrad.core.world import Elastic, ResizeRequest
from lightning_simigrad.data.sampler import AdaptiveBatchSampler
from lightning_simigrad.data.schedule import WindowSchedule
from lightning_simigrad.measurement import Measurement, MeasurementError, RankGroupMeasurement

try:
    __version__ = importlib.metadata.version("lightning-simigrad")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, never installed: no metadata
    __version__ = "0+unknown"

__all__ = [
    "METRICS",
    "AdaptiveBatchSampler",
    "BatchSchedule",
    "BatchSizeController",
    "BatchSizeSchedule",
    "Elastic",
    "HalfStats",
    "Measurement",
    "MeasurementError",
    "RankGroupMeasurement",
    "ResizeRequest",
    "SimiGrad",
    "Unit",
    "Window",
    "WindowSchedule",
    "doubling",
    "equilibrium_batch_size",
    "expected_similarity",
    "linear_ramp",
    "lr_factor",
    "plan_window",
]

"""``benchmarks/critical_batch.py``: the fit of McCandlish et al.'s step-sample trade-off and the first reach."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "critical_batch.py"
spec = importlib.util.spec_from_file_location("critical_batch", SCRIPT)
assert spec is not None and spec.loader is not None
critical_batch = importlib.util.module_from_spec(spec)
sys.modules["critical_batch"] = critical_batch
spec.loader.exec_module(critical_batch)


def test_the_fit_recovers_the_critical_batch_of_an_exact_trade_off() -> None:
    # S(B) = S_min (1 + B_crit / B) with S_min = 40, B_crit = 96: E_min = 3840
    steps = {b: 40 * (1 + 96 / b) for b in (16, 32, 64, 128, 256)}
    s_min, e_min = critical_batch.fit(steps)
    assert s_min == pytest.approx(40) and e_min == pytest.approx(3840) and e_min / s_min == pytest.approx(96)


def test_a_target_is_reached_at_the_first_validation_at_or_below_it() -> None:
    curve = [(10, 160, 0.5), (20, 320, 0.2), (30, 480, 0.25), (40, 640, 0.1)]
    assert critical_batch.first_reach(curve, 0.2) == (20, 320)
    assert critical_batch.first_reach(curve, 0.05) is None


def test_the_logged_values_are_read_where_the_target_was_reached() -> None:
    traces = [[{"samples_seen": s, "noise_scale": s / 10, "batch_size": 16.0} for s in (100, 200, 300)]] * 3
    assert critical_batch.at_samples(traces, 150, "noise_scale") == 20
    assert math.isnan(critical_batch.at_samples(traces, 400, "noise_scale"))  # no run got that far

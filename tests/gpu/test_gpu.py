"""The GPU checks, one test per property, run by ``pytest -m gpu`` on a machine with CUDA (skipped without).

Each test runs one check of ``benchmarks/gpu_check.py`` (the same code, which ``tests/distributed/test_gpu_check.py``
also runs on CPU processes) and fails on any row that reports a failure; goals it measures (step-time ratios) are
printed, not asserted: figures belong to the benchmark's table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with `pytest -m gpu`)"),
]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # gpu_check imports its neighbours by bare name, as a script does
import gpu_check  # noqa: E402

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0


def passed(rows: list) -> None:
    gpu_check.print_table(rows)
    failed = [row for row in rows if row.status == "FAIL"]
    assert not failed, failed


@pytest.mark.timeout(300)
def test_one_process_statistics_equal_float64_references_in_every_precision():
    passed(gpu_check.check_one_process("cuda"))


@pytest.mark.timeout(600)
def test_step_time_is_measured_against_plain_accumulation():
    passed(gpu_check.check_step_time("cuda", quick=False))


@pytest.mark.timeout(600)
def test_ddp_gradients_are_bitwise_plain_ddps_and_the_statistics_exact():
    if WORLD >= 2:
        passed(gpu_check.check_ddp("cuda", WORLD, quick=True))
    else:  # one GPU: two processes share it under gloo (the measurement stream, CUDA futures, record_stream)
        passed(gpu_check.check_ddp("cuda", 2, quick=True, one_device=True))


@pytest.mark.timeout(600)
@pytest.mark.skipif(WORLD < 2, reason="needs two GPUs")
def test_lightning_ddp_fits_take_the_same_steps_in_every_precision():
    passed(gpu_check.check_lightning_ddp("cuda", WORLD, quick=True))


@pytest.mark.timeout(600)
@pytest.mark.skipif(WORLD < 2, reason="needs two GPUs")
@pytest.mark.parametrize("version", [2, 1], ids=["FSDP2", "FSDP1"])
def test_fsdp_steps_are_exact(version):
    passed(gpu_check.check_fsdp("cuda", WORLD, quick=True, version=version))

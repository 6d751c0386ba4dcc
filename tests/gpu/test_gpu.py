"""The GPU checks, one test per property, run by ``pytest -m gpu`` on a machine with CUDA (skipped without).

Each test runs one check of ``benchmarks/gpu_check.py`` (the same code, which ``tests/distributed/test_gpu_check.py``
also runs on CPU processes) and fails on any row that reports a failure; goals it measures (step-time ratios) are
printed, not asserted: figures belong to the benchmark's table. The allocation test at the end is this file's own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_simigrad import Window
from lightning_simigrad.measurement import window_halves

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


@pytest.mark.timeout(600)
@pytest.mark.skipif(not gpu_check.deepspeed_installed(), reason="needs DeepSpeed")
def test_lightning_deepspeed_fits_at_zero_stages_1_and_2():
    passed(gpu_check.check_lightning_deepspeed("cuda", max(WORLD, 1), quick=True))


@pytest.mark.timeout(300)
def test_after_the_first_window_the_measurement_allocates_no_gradient_sized_block():
    """Steady state: a measured window asks the caching allocator for as many large blocks as plain accumulation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
    model = model.cuda()
    params = list(model.parameters())
    xs = [torch.randn(16, 512, device="cuda") for _ in range(4)]
    ys = [torch.randint(0, 10, (16,), device="cuda") for _ in range(4)]
    w = Window(((16,),) * 4)

    def one_window(measurement) -> int:
        before = torch.cuda.memory_stats()["allocation.large_pool.allocated"]
        for p in params:
            p.grad = None
        fed = [0, 0]
        for j in range(4):
            if measurement is not None:
                measurement.start_micro_batch(w, j, params)
            (nn.functional.cross_entropy(model(xs[j]), ys[j]) / 4).backward()
            fed[j >= 2] += 16
            if measurement is not None:
                measurement.after_backward(w, j, (fed[0], fed[1]), params)
        if measurement is not None:
            measurement.collect(None)
        torch.cuda.synchronize()
        return torch.cuda.memory_stats()["allocation.large_pool.allocated"] - before

    measured = window_halves()
    for _ in range(3):  # warm up both: the caching allocator reserves its blocks in the first windows
        one_window(None)
        one_window(measured)
    plain = [one_window(None) for _ in range(3)]
    ours = [one_window(measured) for _ in range(3)]
    assert ours == plain, (ours, plain)

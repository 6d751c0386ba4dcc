"""`benchmarks/gpu_check.py`: its one-line skip without a GPU, and its GPU code paths run on CPU (gloo)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the children of the fork server get this path too
import gpu_check  # noqa: E402


@pytest.mark.timeout(300)  # beside its own deadlines
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run in full")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and "no CUDA GPU" in done.stdout, done.stdout


@pytest.mark.timeout(300)  # beside its own deadlines
def test_its_gpu_paths_run_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    rows = gpu_check.run("cpu", quick=True, world=4)
    gpu_check.print_table(rows)
    table = capsys.readouterr().out
    checks = [row.check for row in rows]
    # every check the GPU run makes is here: three precisions, two models, W = 2..4, race, soak, timing
    assert sum("one process" in c for c in checks) == 3
    assert sum("step time SimiGrad / plain" in c for c in checks) == 2
    assert all(any(f"W={w}: gradients bitwise" in c for c in checks) for w in (2, 3, 4))
    assert any("held back" in c for c in checks) and any("soak" in c for c in checks)
    assert any("paper's pattern" in row.figure for row in rows)
    assert not [row for row in rows if row.status == "FAIL"], table

"""`benchmarks/gpu_check.py`: its one-line skip without a GPU, and its GPU code paths run on CPU (gloo)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
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


@pytest.mark.timeout(900)  # beside its own deadlines
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
    # Lightning's own strategy="ddp" (its side stream), per precision (on CPU 16-mixed runs as bf16-mixed)
    fits = [row for row in rows if row.check.startswith("Lightning strategy='ddp', 4 cpu processes")]
    assert [p for p in gpu_check.FIT_PRECISIONS if any(p in row.check for row in fits)] == ["16-mixed", "bf16-mixed"]
    # FSDP2 through Lightning's ModelParallelStrategy and FSDP1 through its FSDPStrategy, every step audited
    assert any(c.startswith(f"{gpu_check.FSDP_CHECK}, 4 cpu processes") for c in checks), checks
    assert any(c.startswith(f"{gpu_check.FSDP1_CHECK}, 4 cpu processes") for c in checks), checks
    # what CPU cannot show is in the table too, with the reason
    skipped = [row for row in rows if row.status == "SKIPPED"]
    assert any("measurement stream" in row.check and "needs CUDA" in row.figure for row in skipped), table
    assert any("dead or failing peer under NCCL" in row.check for row in skipped), table
    assert not [row for row in rows if row.status == "FAIL"], table
    assert gpu_check.exit_code(rows) == 0


@pytest.mark.timeout(300)  # beside its own deadline
def test_two_processes_with_gloo_on_one_device_run_on_cpu() -> None:
    # on a one-GPU node: CUDA tensors of one GPU under gloo (measurement stream, CUDA futures, record_stream)
    rows = gpu_check.check_ddp("cpu", 2, quick=True, one_device=True)
    checks = [row.check for row in rows]
    assert all("gloo on one cpu device" in c for c in checks), checks
    assert any("gradients bitwise" in c for c in checks) and any("soak" in c for c in checks), checks
    assert not [row for row in rows if row.status == "FAIL"], rows


def test_one_gpu_reports_a_row_for_everything_it_could_not_check() -> None:
    rows = gpu_check.skipped_rows("cuda", 1)
    assert all(row.status == "SKIPPED" and row.figure for row in rows)
    checks = " / ".join(row.check for row in rows)
    assert "DDP on NCCL" in checks and "stream race" in checks
    assert all(f"Lightning strategy='ddp', {p}" in checks for p in gpu_check.FIT_PRECISIONS)
    assert f"{gpu_check.FSDP_CHECK} on NCCL" in checks and f"{gpu_check.FSDP1_CHECK} on NCCL" in checks
    assert any("needs >= 2 GPUs; this node has 1" in row.figure for row in rows)
    many = " / ".join(row.check for row in gpu_check.skipped_rows("cuda", 8))
    assert "DDP on NCCL" not in many and "gloo on one GPU" in many


def test_a_timing_that_does_not_finish_is_missed_not_failed() -> None:
    exact = {"mismatched": 0, "error": 0.0, "syncs_hook": 0, "syncs_collect": 1}
    soak = {"bad": 0, "error": 0.0, "seconds": 1.0, "steps": 12}
    race = {"mismatched": 0, "error": 0.0}
    gathered = [{"exact W=2": exact, "race": race, "soak": soak} for _ in range(2)]  # no "times": it hung
    rows = gpu_check._ddp_rows(gathered, 2)
    timing = [row for row in rows if "step time" in row.check]
    assert [row.status for row in timing] == ["MISSED"] and "did not finish" in timing[0].figure
    assert gpu_check.exit_code(rows) == 0
    assert gpu_check.exit_code([*rows, gpu_check.Row("x", "FAIL", "")]) == 1


@pytest.mark.timeout(400)  # beside its own deadlines
def test_the_deepspeed_fits_run_on_cpu() -> None:
    pytest.importorskip("deepspeed")
    rows = gpu_check.check_lightning_deepspeed("cpu", 2, quick=True)
    assert [row.check.split(",")[0] for row in rows] == [
        "Lightning strategy='deepspeed_stage_1'",
        "Lightning strategy='deepspeed_stage_2'",
    ]
    assert not [row for row in rows if row.status == "FAIL"], rows

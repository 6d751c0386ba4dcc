"""``benchmarks/elastic_cost.py`` on the trace of a recipe's run and on shapes built here: the fixed worlds'
device-hours grow with W, the elastic plan keeps to its rule's bounds, pays off when restarts are free and the batch
grows 16x, and loses to staying put when a restart costs more than the run."""

from __future__ import annotations

import csv
import doctest
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lightning_simigrad import Elastic
from lightning_simigrad.core.world import ResizeTrigger, WorldRule
from lightning_simigrad_recipes.train import train
from tests.recipes.test_recipes import compose_cfg
from tests.support.helpers import benchmark_module

elastic_cost = benchmark_module("elastic_cost")

# a device whose micro-batches all pay a fixed overhead, with a gradient worth exchanging
DEVICE = elastic_cost.Device(
    overhead_s=1e-3, throughput=1_000.0, grad_bytes=1e6, bandwidth=1e9, latency_s=1e-4, restart_s=0.0
)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits recipe's default run (the batch grows from 16 to ~900 over 12 epochs, ~5 s), without validation.

    The smoke run ``simigrad-trace``'s tests use moves its batch within 8..11, in micro-batches up to 6: too little
    to want another world."""
    out = tmp_path_factory.mktemp("digits")
    # one thread: the small convolutions gain nothing from two, and lose much on a busy machine
    overrides = [
        "num_threads=1", "logger=none", "+trainer.limit_val_batches=0", "trainer.enable_checkpointing=false",
        "trainer.enable_progress_bar=false", f"output_dir={out}",
    ]  # fmt: skip
    return Path(train(compose_cfg(overrides))["trace_csv"])


def test_the_script_runs_on_a_recipe_trace(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert elastic_cost.main(["--trace", str(trace.parent)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("A model, not a measurement of a cluster. Assumptions:\n")
    with trace.open() as f:
        rows = list(csv.DictReader(f))
    sizes = [int(float(row["batch_size"])) for row in rows]
    course = elastic_cost.course_of_trace(trace)
    assert course.sizes == tuple(sizes) and course.unit == "samples"
    assert course.micro_batch == max(float(row["micro_batch_size"]) for row in rows)
    assert f"{len(sizes)} steps, batch {min(sizes)}..{max(sizes)} samples, {sum(sizes):,} samples trained" in out
    plans = [line.split()[1] for line in out.splitlines() if line.startswith("fixed W=")]
    worlds = [int(plan.removeprefix("W=")) for plan in plans]
    # powers of two up to the largest world an elastic plan used, and that one
    largest = max(int(line.split()[-6].split("..")[-1]) for line in out.splitlines() if line.startswith("elastic"))
    assert worlds == elastic_cost.fixed_worlds(largest) and worlds[0] == 1 and worlds[-1] == largest
    assert all(w & (w - 1) == 0 for w in worlds[:-1])
    assert "best fixed world: for wall time fixed W=" in out


def test_a_fixed_world_costs_more_device_hours_the_larger_it_is(trace: Path) -> None:
    for course in (elastic_cost.course_of_trace(trace), shape(16, 256)):
        plans = [elastic_cost.fixed_plan(course, w, DEVICE) for w in (1, 2, 4, 8, 16, 32)]
        assert all(a.device_s < b.device_s for a, b in zip(plans, plans[1:])), [p.device_h for p in plans]
        assert all(p.accumulations == [math.ceil(math.ceil(b / course.micro_batch) / w) for b in course.sizes]
                   for p, w in zip(plans, (1, 2, 4, 8, 16, 32)))  # fmt: skip


def test_the_elastic_world_keeps_within_its_rule(trace: Path) -> None:
    for course in (elastic_cost.course_of_trace(trace), shape(16, 256)):
        # a resize at every change of the wanted world: at most max_accumulation micro-batches a rank, unless the
        # world is at its cap
        free = WorldRule(max_accumulation=2, devices_per_node=1, min_samples_per_rank=1)
        plan = elastic_cost.elastic_plan(course, free, DEVICE, ResizeTrigger(1.0, 1), 0.5)
        assert all(a <= 2 for a in plan.accumulations) and plan.restarts >= 1
        capped = WorldRule(max_accumulation=1, devices_per_node=2, max_nodes=2, min_samples_per_rank=1)
        for trigger in (ResizeTrigger(2.0, 3), ResizeTrigger(1.0, 1)):
            plan = elastic_cost.elastic_plan(course, capped, DEVICE, trigger, 0.5)
            assert max(plan.worlds) <= 4 and all(w % 2 == 0 for w in plan.worlds)
        assert all(a <= 1 or w == 4 for a, w in zip(plan.accumulations, plan.worlds))  # the last: every change


def test_with_free_restarts_following_a_16x_batch_costs_fewer_device_hours_than_any_fixed_world_as_fast() -> None:
    course = shape(16, 256)
    rule = WorldRule(max_accumulation=1, min_samples_per_rank=1)
    fixed, (elastic, _) = elastic_cost.compare(course, rule, DEVICE, ResizeTrigger(2.0, 1), 0.5)
    one = fixed[0]
    assert one.name == "fixed W=1" and elastic.wall_s < one.wall_s and elastic.restarts >= 4  # 2, 4, 8, 16, 32
    as_fast = [p for p in fixed if p.wall_s <= elastic.wall_s]
    assert as_fast, [(p.name, p.wall_h) for p in fixed]
    assert all(elastic.device_s < p.device_s for p in as_fast), [(p.name, p.device_h) for p in as_fast]
    # no fixed world is both as fast and as cheap
    assert not any(p.wall_s <= elastic.wall_s and p.device_s <= elastic.device_s for p in fixed)


def test_when_a_restart_costs_more_than_it_saves_staying_put_wins(trace: Path) -> None:
    for course in (elastic_cost.course_of_trace(trace), shape(16, 256)):
        rule = WorldRule(max_accumulation=1, min_samples_per_rank=1)
        costly = replace(DEVICE, restart_s=1e6)
        elastic = elastic_cost.elastic_plan(course, rule, costly, ResizeTrigger(2.0, 1), 0.5)
        stay = elastic_cost.fixed_plan(course, rule.world(course.sizes[0], course.micro_batch), costly)
        assert elastic.restarts >= 1
        assert elastic.wall_s > stay.wall_s and elastic.device_s > stay.device_s


def test_the_device_model() -> None:
    # the ring all-reduce: nothing on one device, then more with W, below twice the gradient's time
    times = [DEVICE.allreduce_seconds(w) for w in (1, 2, 4, 64, 4096)]
    assert times[0] == 0 and all(a < b for a, b in zip(times, times[1:])) and times[-1] < 2e-3 + 1e-4
    # a profile is interpolated between its points and never cheaper than its fastest one
    profiled = replace(DEVICE, profile=((1.0, 0.002), (4.0, 0.003), (16.0, 0.009)))
    assert profiled.micro_seconds(4) == 0.003 and profiled.micro_seconds(10) == pytest.approx(0.006)
    assert profiled.micro_seconds(0.1) == 0.002 and profiled.micro_seconds(32) == pytest.approx(0.017)
    assert doctest.testmod(elastic_cost).failed == 0


def test_a_profile_file_round_trips_and_times_the_micro_batches(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    points = ((1.0, 0.002), (8.0, 0.004))
    elastic_cost.write_profile(points, tmp_path / "profile.csv")
    assert elastic_cost.read_profile(tmp_path / "profile.csv") == points
    elastic_cost.main(["--trace", str(trace), "--profile-file", str(tmp_path / "profile.csv")])
    assert "t(x) interpolated in a profile of 2 (size, seconds) points: 1: 2 ms, 8: 4 ms" in capsys.readouterr().out
    (tmp_path / "empty.csv").write_text("size,seconds\n")
    with pytest.raises(ValueError, match="holds no"):
        elastic_cost.read_profile(tmp_path / "empty.csv")


def test_the_smoke_mode_states_its_shape_as_an_assumption(capsys: pytest.CaptureFixture[str]) -> None:
    assert elastic_cost.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "BERT-Large shape" in out and "an assumed shape, not data" in out and "batch 128..78,000 samples" in out
    assert (
        "\nfixed W=1 " in out
        and f"\nelastic (x2, {Elastic.patience}) " in out
        and "\nelastic, every step, free " in out
    )


def shape(b0: int, final: int) -> Any:
    """A batch that grows geometrically from ``b0`` to ``final`` over the first half of 40 final batches, in
    micro-batches of 8."""
    sizes = elastic_cost.geometric_shape(b0, final, 40 * final, 0.5)
    return elastic_cost.Course("shape", "samples", sizes, 8, "built in the test")

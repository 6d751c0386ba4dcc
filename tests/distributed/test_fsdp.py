"""SimiGrad under FSDP2: ``fully_shard`` in ``configure_model`` and Lightning's ``ModelParallelStrategy`` (gloo, CPU).

The processes are started by :func:`distributed.run_ok` (real gloo groups, under a deadline) and Lightning treats
them as launched externally (:func:`fsdp_modules.as_external_process`). Each rank returns what it saw: SimiGrad's
history and the reference harness's audit of every step (:class:`~lightning_simigrad.testing.StepAudit`: the full
gradient against the float64 mean over exactly the step's samples, on an unsharded copy of the module, and the
reference similarity of the window's two halves in time).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad, equilibrium_batch_size
from tests.support.distributed import run_ok
from tests.support.fsdp_modules import (
    FSDPRegressor,
    LinearLayerLoss,
    PartlyShardedRegressor,
    Recorder,
    as_external_process,
    fsdp1,
    refusal,
    strategy,
)
from tests.support.helpers import (
    NOISE_SCALE,
    SAMPLES,
    IndexedRegression,
    RegressionLoss,
    Regressor,
    batch_indices,
    known_noise_dataset,
    trainer,
)

N = 150  # samples in the exactness runs' epoch


def same(a, b) -> bool:
    """Equal, NaN equal to NaN (the ranks' values come back pickled, as distinct NaN objects)."""
    return json.dumps(a) == json.dumps(b)


def simigrad_of(trainer: pl.Trainer) -> SimiGrad:
    return next(c for c in trainer.callbacks if isinstance(c, SimiGrad))


# ---------------------------------------------------------------------------------------------- exactness
def audited_fit(rank: int, world: int, fsdp_version: int = 2, sharding: str = "FULL_SHARD") -> dict:
    """Two epochs, every step audited; FSDP2 (``fully_shard`` in ``configure_model``) or FSDP1 (``sharding``)."""
    as_external_process(rank, world)
    cb = SimiGrad(target_similarity=0.9, max_micro_batch_size=5)
    if fsdp_version == 2:
        module, parallel = FSDPRegressor(), strategy(world)
    else:
        module, parallel = Regressor(), fsdp1(world, sharding_strategy=sharding)
    return audited(world, module, parallel, IndexedRegression(N), cb)[0]


def audited(world: int, module: pl.LightningModule, parallel: Any, dataset: Any, cb: SimiGrad) -> tuple[dict, Any]:
    """A two-epoch fit of ``module`` under ``parallel`` with ``cb`` and the step audit after it: what
    :func:`check_exact_steps` reads, and the Trainer."""
    audit = Recorder(indices=batch_indices, mean_loss=RegressionLoss(dataset))
    t = trainer(devices=world, strategy=parallel, max_epochs=2, callbacks=[cb, audit])
    t.fit(module, DataLoader(dataset, batch_size=5, shuffle=True))
    result = dict(
        history=cb.history,
        steps=[dataclasses.asdict(step) for step in audit.steps],
        products=audit.recorded.products,
        measurement=composition(cb.run.measurement),
        min_micro_batches=cb.run.measurement.min_micro_batches,
    )
    return result, t


def composition(measurement) -> str:  # type: ignore[no-untyped-def]
    """What a measurement is made of: its halves, and for halves in time how they read and keep the gradient."""
    halves = measurement.halves
    parts = [type(halves).__name__]
    if hasattr(halves, "pieces"):
        parts += [type(halves.pieces).__name__, type(halves.aside).__name__]
    return "/".join(parts)


def check_exact_steps(
    ranks: list[dict],
    world: int,
    measurement: str = "TimeHalves/ShardedPieces/MoveAside",
    min_micro_batches: int = 2,
    products_rel: float = 1e-6,
    grad_rel: float = 1e-6,
) -> None:
    history = ranks[0]["history"]
    assert all(same(r["history"], history) for r in ranks)  # every rank took the same decisions
    assert ranks[0]["measurement"] == measurement and ranks[0]["min_micro_batches"] == min_micro_batches
    steps = ranks[0]["steps"]
    assert len(steps) == len(history)
    assert len({h["batch_size"] for h in history}) > 2  # the batch moved
    assert min(h["batch_size"] for h in history) >= min_micro_batches * world  # a micro-batch per half at least
    for step, row, measured in zip(steps, history, ranks[0]["products"], strict=True):
        every = step["samples"]  # every rank's samples of the step
        assert len(every) == len(set(every)) == row["batch_size"]
        assert step["ranks_identical"]
        assert step["grad_rel_error"] < grad_rel, step["grad_rel_error"]  # float64 throughout, unless said
        assert len(step["halves"][0]) + len(step["halves"][1]) == row["batch_size"]
        if math.isfinite(row["similarity"]):
            assert row["similarity"] == pytest.approx(step["similarity"], abs=1e-5)
            # g_A.g_B, |g_A|^2, |g_B|^2 themselves (the noise scale reads them; the cosine hides a common factor);
            # the dot product relative to |g_A| |g_B|, the scale its rounding has
            (dot, sq_a, sq_b), (ref_dot, ref_a, ref_b) = measured, step["halves_products"]
            assert [sq_a, sq_b] == pytest.approx([ref_a, ref_b], rel=products_rel)
            assert abs(dot - ref_dot) <= products_rel * math.sqrt(ref_a * ref_b), (dot, ref_dot)
    assert sum(math.isfinite(h["similarity"]) for h in history) >= len(history) - 2  # only tiny tails unmeasured
    # each sample once per epoch across all ranks
    seen = [i for s in steps for i in s["samples"]]
    assert sorted(seen) == sorted(list(range(N)) * 2)
    epoch_end = next(k for k in range(len(steps)) if history[k]["samples_seen"] == N)
    assert sorted(i for s in steps[: epoch_end + 1] for i in s["samples"]) == list(range(N))


@pytest.mark.timeout(150)
def test_fsdp_steps_are_exact_and_measure_the_halves_in_time(run_ok):
    check_exact_steps(run_ok(audited_fit, 2, deadline_s=120), 2)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp_steps_are_exact_on_four_ranks(run_ok):
    check_exact_steps(run_ok(audited_fit, 4, deadline_s=360), 4)


# ---------------------------------------------------------------------------------------------- equilibrium
TARGET = 0.8


def _equilibrium_fit(rank: int, world: int) -> list[dict]:
    as_external_process(rank, world)
    pl.seed_everything(0)  # the shuffling order (unseeded runs settled at 0.93 to 1.02 B*)
    # max_steps counts optimizer steps here (not steps of B0 samples): 150 steps, whatever their size
    cb = SimiGrad(target_similarity=TARGET, max_micro_batch_size=256, schedule_by_samples=False)
    t = trainer(devices=world, strategy=strategy(world), max_steps=150, max_epochs=-1, callbacks=[cb])
    t.fit(LinearLayerLoss(), DataLoader(known_noise_dataset(), batch_size=16, shuffle=True))
    return cb.history


@pytest.mark.timeout(150)
def test_fsdp_batch_size_settles_at_the_equilibrium(run_ok):
    ranks = run_ok(_equilibrium_fit, 2, deadline_s=120)
    history = ranks[0]
    assert all(same(r, history) for r in ranks)
    expected = equilibrium_batch_size(NOISE_SCALE, TARGET, population=SAMPLES)
    assert history[0]["batch_size"] == 32  # B0: 16 per rank
    settled = statistics.median(h["batch_size"] for h in history[-60:])
    assert 0.85 * expected <= settled <= 1.15 * expected, (settled, expected)
    assert history[-1]["noise_scale"] == pytest.approx(NOISE_SCALE, rel=0.2)


# ---------------------------------------------------------------------------------------------- resume
STOP = 5  # optimizer steps the interrupted fit trains, inside its first epoch
RESUME_N = 203


class Record(pl.Callback):
    """After SimiGrad: the samples this rank fed in every step; stops the fit after ``stop`` steps."""

    def __init__(self, stop: int | None = None) -> None:
        self.stop = stop
        self.fed: list[int] = []
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if simigrad_of(trainer).local_samples:  # 0: a zero-weight padding sample
            self.fed += batch[0].tolist()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.steps.append(dict(epoch=simigrad_of(trainer).schedule.current.epoch, samples=self.fed))
        self.fed = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.stop is not None and trainer.global_step == self.stop:
            trainer.should_stop = True  # after the checkpoint callback (listed before) has saved this step


def _resumable_fit(
    rank: int,
    world: int,
    out: Path,
    stop: int | None,
    ckpt_path: Path | None,
    sharded: bool = True,
    fsdp_version: int = 2,
) -> dict:
    as_external_process(rank, world)
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_batch_size=120, max_micro_batch_size=6)
    record = Record(stop)
    checkpoint = ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=STOP, save_top_k=-1)
    if fsdp_version == 2:
        module, parallel = FSDPRegressor(), strategy(world, save_distributed_checkpoint=sharded)
    else:
        module, parallel = Regressor(), fsdp1(world, state_dict_type="sharded" if sharded else "full")
    t = trainer(
        devices=world, strategy=parallel, max_epochs=2, enable_checkpointing=True, callbacks=[cb, checkpoint, record]
    )
    t.fit(module, DataLoader(IndexedRegression(RESUME_N), batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    return dict(history=cb.history, steps=record.steps)


def steps_of(ranks: list[dict]) -> list[dict]:
    """Every step with the samples of all ranks together."""
    assert all(same(r["history"], ranks[0]["history"]) for r in ranks)  # every rank took the same decisions
    return [
        dict(epoch=per_rank[0]["epoch"], samples=[i for s in per_rank for i in s["samples"]])
        for per_rank in zip(*(r["steps"] for r in ranks), strict=True)
    ]


def interrupted(out: Path, world: int, sharded: bool = True, fsdp_version: int = 2) -> tuple[Path, list[dict]]:
    """A fit stopped after STOP steps with a checkpoint written there, inside the first epoch."""
    ranks = run_ok(_resumable_fit, world, out, STOP, None, sharded, fsdp_version, deadline_s=120)
    path = out / f"step={STOP}.ckpt"
    assert path.is_dir() if sharded else path.is_file()  # a folder of shards, or one file of the full state
    assert ranks[0]["history"][-1]["samples_seen"] < RESUME_N  # inside the first epoch
    return path, ranks


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded-state", "full-state"])
@pytest.mark.parametrize("fsdp_version", [2, 1], ids=["fsdp2", "fsdp1"])
def test_fsdp_mid_epoch_resume_continues_the_same_run(tmp_path, sharded, fsdp_version, run_ok):
    whole = run_ok(_resumable_fit, 2, tmp_path / "whole", None, None, sharded, fsdp_version, deadline_s=120)
    path, part = interrupted(tmp_path / "part", 2, sharded, fsdp_version)
    resumed = run_ok(_resumable_fit, 2, tmp_path / "resumed", None, path, sharded, fsdp_version, deadline_s=120)
    before, after, history = part[0]["history"], resumed[0]["history"], whole[0]["history"]
    assert len(before) == STOP
    assert same(before, history[:STOP])
    assert [h["batch_size"] for h in after] == [h["batch_size"] for h in history[STOP:]]
    for key in history[0]:  # similarity, noise scale, learning rate, samples seen, ...: row for row
        rest = [h[key] for h in history[STOP:]]
        assert [h[key] for h in after] == pytest.approx(rest, abs=1e-9, nan_ok=True), key
    assert steps_of(part) + steps_of(resumed) == steps_of(whole)  # the same samples, step for step


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "world,resumed_world,fsdp_version",
    # FSDP1: from two rank groups inside the reduce-scatter (even W) to the halves in time (odd W), and back
    [(2, 4, 2), (4, 2, 2), (2, 3, 1), (3, 2, 1)],
)
def test_fsdp_checkpoint_resumes_on_another_number_of_ranks(tmp_path, world, resumed_world, fsdp_version, run_ok):
    path, part = interrupted(tmp_path / "part", world, fsdp_version=fsdp_version)
    resumed = run_ok(
        _resumable_fit, resumed_world, tmp_path / "resumed", None, path, True, fsdp_version, deadline_s=240
    )
    before, after = steps_of(part), steps_of(resumed)
    history = resumed[0]["history"]
    # the rest of the first epoch and the whole second one, every sample once across the new ranks
    for epoch in (0, 1):
        assert sorted(i for s in before + after if s["epoch"] == epoch for i in s["samples"]) == list(range(RESUME_N))
    assert len(history) == len(after)
    assert all(len(s["samples"]) == h["batch_size"] for s, h in zip(after, history, strict=True))
    assert history[0]["step"] == STOP
    assert history[0]["samples_seen"] == part[0]["history"][-1]["samples_seen"] + history[0]["batch_size"]
    # two micro-batches per rank at least for halves in time, one for two rank groups (FSDP1 at an even W)
    per_rank = 1 if fsdp_version == 1 and resumed_world % 2 == 0 else 2
    assert min(h["batch_size"] for h in history) >= per_rank * resumed_world
    assert len({h["batch_size"] for h in history}) > 2  # the controller keeps adapting on the new ranks


# ---------------------------------------------------------------------------------------------- refusals
def _refused_fit(rank: int, world: int, case: str) -> tuple[str, int]:
    as_external_process(rank, world)
    if case == "mesh short of the world":  # tensor_parallel_size=2, but only `fully_shard` over the 1-rank dp mesh
        module, parallel = FSDPRegressor(), strategy(world, tensor_parallel_size=2)
    else:
        module, parallel = PartlyShardedRegressor(), strategy(world)
    return refusal(trainer(devices=world, strategy=parallel, callbacks=[SimiGrad(target_similarity=0.8)]), module)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case,message",
    [
        ("mesh short of the world", "spans 1 of the 2 ranks: its gradient is not reduced over the others"),
        ("parameter left plain", "Apply `fully_shard` to the root"),
    ],
)
def test_what_fsdp_measurement_cannot_serve_is_refused_before_the_first_step(case, message, run_ok):
    for error, trained in run_ok(_refused_fit, 2, case, deadline_s=90):
        assert message in error
        assert trained == 0

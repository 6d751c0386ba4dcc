"""SimiGrad under FSDP1: Lightning's ``FSDPStrategy`` (through a CPU subclass, gloo), each ``nn.Linear`` its own unit.

FSDP1 accumulates inside ``no_sync`` (each rank's gradient unreduced and unsharded until the window's last
backward); the measurement has the last backward of the window's first half reduce too
(:func:`lightning_simigrad.measurement.midpoint_reduction`). The audit (:class:`~lightning_simigrad.testing.StepAudit`)
reads the full gradient with ``summon_full_params`` and recomputes it in float64 over exactly the step's samples
(Lightning's FSDP1 precision ``32-true`` computes the float64 module in float32: relative errors about 1e-7).
"""

from __future__ import annotations

import dataclasses
import math

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel
from torch.utils.data import DataLoader

from lightning_simigrad import MeasurementError, SimiGrad
from lightning_simigrad.testing import StepAudit
from tests.distributed.test_fsdp import N, audited_fit, check_exact_steps
from tests.support.fsdp_modules import as_external_process, fsdp1, refusal
from tests.support.helpers import IndexedRegression, RegressionLoss, Regressor, batch_indices, trainer

# the halves' products computed in float32 (FSDP1 under Lightning's `32-true`) against float64: up to 2e-5 seen
FLOAT32 = 1e-4


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_fsdp1_steps_are_exact_and_measure_two_rank_groups_inside_the_reduce_scatter(sharding, run_ok):
    ranks = run_ok(audited_fit, 2, 1, sharding, deadline_s=120)
    check_exact_steps(ranks, 2, "ReduceScatterGroups", min_micro_batches=1, products_rel=FLOAT32)


@pytest.mark.timeout(200)
def test_fsdp1_on_four_ranks_reduces_in_two_stages_exactly(run_ok):
    # groups {0, 1} and {2, 3} reduce-scatter within themselves, then partners (0, 2) and (1, 3) exchange halves
    ranks = run_ok(audited_fit, 4, 1, "FULL_SHARD", deadline_s=170)
    check_exact_steps(ranks, 4, "ReduceScatterGroups", min_micro_batches=1, products_rel=FLOAT32)


@pytest.mark.timeout(200)
def test_fsdp1_on_an_odd_number_of_ranks_reduces_at_the_midpoint_too_and_measures_the_halves_in_time(run_ok):
    ranks = run_ok(audited_fit, 3, 1, "FULL_SHARD", deadline_s=170)
    check_exact_steps(ranks, 3, "TimeHalves/LocalPieces/CopyAside", products_rel=FLOAT32)


class OwnCommunicationHook(pl.Callback):
    """A user's FSDP1 communication hook, registered when the fit starts (FSDP1 takes one)."""

    def on_fit_start(self, trainer, pl_module):
        from torch.distributed.algorithms._comm_hooks import default_hooks

        state = default_hooks.DefaultState(torch.distributed.group.WORLD)
        trainer.strategy.model.register_comm_hook(state, default_hooks.reduce_scatter_hook)


def _refused_fit(rank: int, world: int, case: str) -> tuple[str, int]:
    as_external_process(rank, world)
    kwargs = {
        "hybrid": dict(sharding_strategy="HYBRID_SHARD"),
        "no shard": dict(sharding_strategy="NO_SHARD"),
        "cpu offload": dict(cpu_offload=CPUOffload(offload_params=True)),
    }.get(case, {})
    if case == "subgroup":  # two halves of the ranks, each sharding over itself: nothing reduces between them
        halves = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
        kwargs = dict(process_group=halves[rank // 2])
    module = Regressor()
    others = [OwnCommunicationHook()] if case == "own hook" else []
    callbacks = [SimiGrad(target_similarity=0.8), *others]
    return refusal(trainer(devices=world, strategy=fsdp1(world, **kwargs), callbacks=callbacks), module)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "case,message",
    [
        ("hybrid", "uses HYBRID_SHARD"),
        ("no shard", "uses NO_SHARD"),
        ("cpu offload", "does not support CPU offload"),
        ("subgroup", "is sharded over ranks ["),
        ("own hook", "this model has one already"),
    ],
)
def test_what_fsdp1_measurement_cannot_serve_is_refused_before_the_first_step(case, message, run_ok):
    for error, trained in run_ok(_refused_fit, 4 if case == "subgroup" else 2, case, deadline_s=90):
        assert message in error
        assert trained == 0


class ClippedNorm(pl.Callback):
    """The norm of the gradient the optimizer applied, read where the next window zeroes it (after clipping)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        with FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False, with_grads=True):
            grads = [p.grad.double().reshape(-1) for p in pl_module.parameters() if p.grad is not None]
            if grads:
                self.norms.append(float(torch.cat(grads).norm()))


CLIP = 0.05


class ClippedRegressor(Regressor):
    """Norm clipping as Lightning documents it under FSDP1 (`gradient_clip_val` clips by norm only without FSDP)."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.trainer.strategy.model.clip_grad_norm_(CLIP)  # FSDP1's sharded clip: the norm over every rank's shard


def _mixed_precision_clipped_fit(rank: int, world: int) -> dict:
    as_external_process(rank, world)
    dataset = IndexedRegression(N, dtype=torch.float32)  # FSDP1's clip_grad_norm_ takes no float64 gradient
    audit = StepAudit(indices=batch_indices, mean_loss=RegressionLoss(dataset))
    cb, clipped = SimiGrad(target_similarity=0.9, max_micro_batch_size=5), ClippedNorm()
    t = trainer(
        devices=world,
        strategy=fsdp1(world),
        precision="bf16-mixed",
        max_epochs=1,
        callbacks=[cb, audit, clipped],
    )
    t.fit(ClippedRegressor(dtype=torch.float32), DataLoader(dataset, batch_size=5, shuffle=True))
    return dict(history=cb.history, steps=[dataclasses.asdict(s) for s in audit.steps], clipped=clipped.norms)


@pytest.mark.timeout(150)
def test_fsdp1_bf16_mixed_precision_and_gradient_clipping_work_unchanged(run_ok):
    ranks = run_ok(_mixed_precision_clipped_fit, 2, deadline_s=120)
    history, steps, clipped = ranks[0]["history"], ranks[0]["steps"], ranks[0]["clipped"]
    assert len({h["batch_size"] for h in history}) > 2  # measured and adapting
    measured = [(h, s) for h, s in zip(history, steps) if math.isfinite(h["similarity"])]
    assert len(measured) >= len(history) - 2
    for row, step in measured:  # bf16 forward and backward, bf16 reduction: about 1e-2 of the float64 reference
        assert step["grad_rel_error"] < 5e-2
        assert row["similarity"] == pytest.approx(step["similarity"], abs=5e-2)
    # FSDP1's sharded clip_grad_norm_ ran on the gradient SimiGrad left: every step applied a norm of at most CLIP
    assert len(clipped) == len(history) - 1 and all(n <= CLIP * (1 + 1e-3) for n in clipped), clipped
    assert sum(n > 0.99 * CLIP for n in clipped) >= len(clipped) // 2  # and clipping was active


def _failing_fit(rank: int, world: int) -> dict:
    """Rank 1's products fail inside the reduce-scatter hook at its third unit: every rank must stop alike."""
    from lightning_simigrad.measurement import reduce_scatter_groups

    as_external_process(rank, world)
    calls, gram = [0], reduce_scatter_groups.gram

    def failing(u, v):
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            raise FloatingPointError("a fault in rank 1's products")
        return gram(u, v)

    reduce_scatter_groups.gram = failing
    cb = SimiGrad(target_similarity=0.9, max_micro_batch_size=5)
    t = trainer(devices=world, strategy=fsdp1(world), max_epochs=1, callbacks=[cb])
    try:
        t.fit(Regressor(), DataLoader(IndexedRegression(N), batch_size=5, shuffle=True))
    except MeasurementError as error:
        return dict(error=str(error), cause=repr(error.__cause__), steps=len(cb.history), at=t.global_step)
    return dict(error="", steps=len(cb.history))


@pytest.mark.timeout(120)
def test_a_fault_in_one_ranks_products_stops_every_rank_at_the_same_step(run_ok):
    ranks = run_ok(_failing_fit, 2, deadline_s=90)
    assert all("failed on rank 1" in r["error"] for r in ranks), ranks
    assert "FloatingPointError" in ranks[1]["cause"] and ranks[0]["cause"] == "None"
    # the second step's hook failed (two units a step): no rank stepped on it
    assert [r["steps"] for r in ranks] == [1, 1] and [r["at"] for r in ranks] == [1, 1]


def _history(rank: int, world: int, use_orig_params: bool) -> list[tuple[float, float]]:
    as_external_process(rank, world)
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_micro_batch_size=5)
    t = trainer(devices=world, strategy=fsdp1(world, use_orig_params=use_orig_params), max_epochs=1, callbacks=[cb])
    t.fit(Regressor(), DataLoader(IndexedRegression(N), batch_size=5, shuffle=True))
    return [(h["batch_size"], h["similarity"]) for h in cb.history]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])  # two stages (which never reads the parameters), the midpoint (which does)
def test_flat_parameters_are_measured_as_the_original_ones(world, run_ok):
    # `use_orig_params=False`: the optimizer and the measurement see FSDP1's FlatParameters, whose gradients the
    # audit cannot gather; the run must take the same decisions on the same measurements as with the originals
    original = run_ok(_history, world, True, deadline_s=90)[0]
    flat = run_ok(_history, world, False, deadline_s=90)[0]
    assert [b for b, _ in flat] == [b for b, _ in original] and len({b for b, _ in flat}) > 2
    assert [s for _, s in flat] == pytest.approx([s for _, s in original], abs=1e-6, nan_ok=True)

"""SimiGrad under DeepSpeed ZeRO stages 1 and 2: Lightning's ``DeepSpeedStrategy`` through
:class:`~lightning_simigrad.testing.CPUDeepSpeedStrategy` on 1 to 3 CPU processes (gloo), DeepSpeed's CPU accelerator.

The engine accumulates the gradient into its ZeRO optimizer, where each rank keeps a partition; the measurement
(:mod:`lightning_simigrad.measurement.zero_partitions`) sets the first half's partition aside at the window's midpoint
and measures on the partitions. The audit (:class:`~lightning_simigrad.testing.StepAudit`) reads the gradient the
engine is about to step with through ``deepspeed.utils.safe_get_full_grad`` and recomputes it over exactly the step's
samples; Lightning's DeepSpeed precision trains in float32, so errors are float32's (about 1e-7). Skipped where
DeepSpeed is not installed (``pip install --no-build-isolation 'deepspeed>=0.19,<0.20'``; `.ci/run` installs it).
"""

from __future__ import annotations

import os
import re
import statistics
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad, equilibrium_batch_size
from lightning_simigrad.testing import CPUDeepSpeedStrategy, StepAudit
from tests.distributed.test_fsdp import RESUME_N, STOP, N, Record, audited, check_exact_steps, same, steps_of
from tests.support.fsdp_modules import as_external_process
from tests.support.helpers import (
    NOISE_SCALE,
    SAMPLES,
    IndexedRegression,
    LinearLoss,
    Regressor,
    batch_indices,
    known_noise_dataset,
    step_audit,
    trainer,
)
from tests.support.streams import IndexedStream, each_sample_once
from tests.support.token_modules import Sequences, TokenMeanLoss, TokenModel, indices_of, labelled_tokens, pad_collate

pytest.importorskip("deepspeed")


FLOAT32 = 1e-4  # the halves' products in float32 against the audit's float32 reference


def deepspeed(stage: int, **kwargs) -> CPUDeepSpeedStrategy:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's own choice where no GPU is found, said outright
    return CPUDeepSpeedStrategy(stage=stage, process_group_backend="gloo", **kwargs)


def _audited_fit(rank: int, world: int, stage: int) -> dict:
    as_external_process(rank, world)
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_micro_batch_size=5, smoothing=0.5, max_batch_size=120)
    module = Regressor(dtype=torch.float32, scheduler=True)  # StepLR stepped per B0 samples (Lightning's "step")
    result, t = audited(world, module, deepspeed(stage), IndexedRegression(N, dtype=torch.float32), cb)
    return result | dict(global_step=t.global_step, engine_steps=t.strategy.model.global_steps)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_step_is_the_mean_over_exactly_its_samples(world, stage, run_ok):
    ranks = run_ok(_audited_fit, world, stage, deadline_s=240)
    check_exact_steps(ranks, world, "ZeroPartitions", products_rel=FLOAT32, grad_rel=2e-6)
    # Lightning's count of optimizer steps is the engine's, one per window
    assert ranks[0]["global_step"] == ranks[0]["engine_steps"] == len(ranks[0]["history"])


class AppliedLR(pl.Callback):
    """The learning rate the torch optimizer inside DeepSpeed's ZeRO optimizer holds while it steps."""

    def __init__(self) -> None:
        self.applied: list[float] = []

    def on_train_start(self, trainer, pl_module):  # after SimiGrad's hooks went on (when the fit started)
        inner = trainer.optimizers[0].optimizer
        inner.register_step_pre_hook(lambda optimizer, *_: self.applied.append(optimizer.param_groups[0]["lr"]))


def _bf16_fit(rank: int, world: int, stage: int) -> dict:
    """``precision="bf16-mixed"``: DeepSpeed trains and accumulates in bf16; the audit's reference is the float32
    gradient at the same (bf16) weights."""
    as_external_process(rank, world)
    pl.seed_everything(0)
    dataset = IndexedRegression(N, dtype=torch.float32)

    def mean_loss(module: Regressor, indices: list[int]) -> torch.Tensor:
        module.float()  # a copy of the trained module: its bf16 weights, in float32
        return module.loss(dataset.x[indices], dataset.y[indices])

    audit = StepAudit(indices=batch_indices, mean_loss=mean_loss)
    cb = SimiGrad(target_similarity=0.9, max_micro_batch_size=5, smoothing=0.5, max_batch_size=120)
    t = trainer(devices=world, strategy=deepspeed(stage), precision="bf16-mixed", max_epochs=2, callbacks=[cb, audit])
    t.fit(Regressor(dtype=torch.float32), DataLoader(dataset, batch_size=5, shuffle=True))
    return dict(
        history=cb.history,
        errors=[s.grad_rel_error for s in audit.steps],
        similarity=[s.similarity for s in audit.steps],
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_steps_are_exact_to_bf16s_own_rounding(stage, run_ok):
    result = run_ok(_bf16_fit, 2, stage, deadline_s=240)[0]
    assert len({h["batch_size"] for h in result["history"]}) > 2  # the batch moved
    # bf16 accumulation rounds each gradient to 8 bits: about 1e-2 of it, as plain DeepSpeed in bf16
    assert max(result["errors"]) < 3e-2, result["errors"]
    measured = [(h["similarity"], ref) for h, ref in zip(result["history"], result["similarity"], strict=True)]
    assert max(abs(ours - ref) for ours, ref in measured if ref == ref) < 2e-2, measured


def _token_fit(rank: int, world: int, stage: int) -> dict:
    """``loss_items``: every labelled token of a step weighs 1 / (the step's labelled tokens on every rank), the
    module's loss PyTorch's mean over a micro-batch's labelled tokens (tests/support/token_modules.py)."""
    as_external_process(rank, world)
    pl.seed_everything(0)
    dataset = Sequences()
    audit = StepAudit(indices=indices_of, mean_loss=TokenMeanLoss(dataset))
    cb = SimiGrad(0.5, loss_items=labelled_tokens, max_micro_batch_size=3, initial_batch_size=4 * world)
    t = trainer(devices=world, strategy=deepspeed(stage), max_epochs=2, callbacks=[cb, audit])
    t.fit(TokenModel(dtype=torch.float32), DataLoader(dataset, batch_size=3, shuffle=True, collate_fn=pad_collate))
    return dict(history=cb.history, steps=[(len(s.samples), s.grad_rel_error, s.similarity) for s in audit.steps])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [1, 2])
def test_with_loss_items_every_step_is_the_mean_over_its_labelled_tokens(world, stage, run_ok):
    result = run_ok(_token_fit, world, stage, deadline_s=240)[0]
    history, steps = result["history"], result["steps"]
    assert len({h["batch_size"] for h in history}) >= 3  # the batch moved
    assert [h["batch_size"] for h in history] == [n for n, _, _ in steps]  # batch sizes count samples
    assert max(error for _, error, _ in steps) < 2e-6  # the item mean, rescaled in DeepSpeed's partitions
    measured = [(h["similarity"], ref) for h, (_, _, ref) in zip(history, steps, strict=True)]
    assert max(abs(ours - ref) for ours, ref in measured if ref == ref) < 1e-5  # cos of the halves' token means


def _stream_fit(rank: int, world: int) -> dict:
    """A stream (an ``IterableDataset`` whose every rank reads its own part), re-batched into the windows."""
    as_external_process(rank, world)
    pl.seed_everything(0)
    dataset = IndexedRegression(N, dtype=torch.float32)
    audit = step_audit(dataset)
    cb = SimiGrad(initial_batch_size=8 * world, target_similarity=0.3)
    t = trainer(devices=world, strategy=deepspeed(2), max_epochs=2, callbacks=[cb, audit])
    t.fit(Regressor(dtype=torch.float32), DataLoader(IndexedStream(dataset, shuffle=True), batch_size=4))
    return dict(samples=[s.samples for s in audit.steps], errors=[s.grad_rel_error for s in audit.steps])


@pytest.mark.timeout(300)
def test_a_stream_is_rebatched_into_exact_windows(run_ok):
    result = run_ok(_stream_fit, 2, deadline_s=240)[0]
    each_sample_once(result["samples"], N, 2)
    assert len({len(s) for s in result["samples"][:-1]}) >= 2  # the batch moved
    assert max(result["errors"]) < 2e-6


def _counted_fit(rank: int, world: int) -> dict:
    """``max_steps`` and a step-interval scheduler counted in optimizer steps (``schedule_by_samples=False``)."""
    as_external_process(rank, world)
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_micro_batch_size=4, schedule_by_samples=False)
    applied = AppliedLR()
    module = Regressor(dtype=torch.float32, scheduler=True)
    t = trainer(devices=world, strategy=deepspeed(2), max_steps=9, max_epochs=-1, callbacks=[cb, applied])
    t.fit(module, DataLoader(IndexedRegression(400, dtype=torch.float32), batch_size=4, shuffle=True))
    scheduler = t.lr_scheduler_configs[0].scheduler
    return dict(
        history=cb.history,
        global_step=t.global_step,
        engine_steps=t.strategy.model.global_steps,
        scheduler_steps=scheduler.last_epoch,
        lr=t.optimizers[0].param_groups[0]["lr"],
        applied=applied.applied,
    )


@pytest.mark.timeout(200)
def test_max_steps_and_a_scheduler_count_the_optimizer_steps_taken(run_ok):
    ranks = run_ok(_counted_fit, 2, deadline_s=160)
    counts = ranks[0]
    assert len({h["batch_size"] for h in counts["history"]}) > 1  # the windows varied
    assert counts["global_step"] == counts["engine_steps"] == counts["scheduler_steps"] == len(counts["history"]) == 9
    assert counts["lr"] == pytest.approx(0.05 * 0.5**3)  # StepLR(step_size=3, gamma=0.5) after 9 steps
    # each step applies the scheduler's rate times SimiGrad's factor for its batch (the LR rule), then gives it back
    assert counts["applied"] == pytest.approx([h["lr"] for h in counts["history"]], rel=1e-12)
    assert len({round(h["lr_scale"], 9) for h in counts["history"]}) > 1


TARGET = 0.8


def _equilibrium_fit(rank: int, world: int) -> list[dict]:
    as_external_process(rank, world)
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=TARGET, max_micro_batch_size=256, schedule_by_samples=False)
    t = trainer(devices=world, strategy=deepspeed(2), max_steps=150, max_epochs=-1, callbacks=[cb])
    dataset = known_noise_dataset()
    dataset.tensors = tuple(t.float() for t in dataset.tensors)  # Lightning's DeepSpeed precision: float32
    t.fit(LinearLoss(), DataLoader(dataset, batch_size=16, shuffle=True))
    return cb.history


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_the_batch_settles_at_the_equilibrium(world, run_ok):
    history = run_ok(_equilibrium_fit, world, deadline_s=240)[0]
    expected = equilibrium_batch_size(NOISE_SCALE, TARGET, population=SAMPLES)
    settled = statistics.median(h["batch_size"] for h in history[-60:])
    assert 0.85 * expected <= settled <= 1.15 * expected, (settled, expected)


def _resumable_fit(rank: int, world: int, out: Path, stop: int | None, ckpt_path: Path | None) -> dict:
    as_external_process(rank, world)
    pl.seed_everything(0)
    cb = SimiGrad(target_similarity=0.9, max_batch_size=120, max_micro_batch_size=6)
    record = Record(stop)
    checkpoint = ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=STOP, save_top_k=-1)
    module = Regressor(dtype=torch.float32, dropout=0.2)  # random draws: every rank's generators must come back
    t = trainer(
        devices=world,
        strategy=deepspeed(2),
        max_epochs=2,
        enable_checkpointing=True,
        callbacks=[cb, checkpoint, record],
    )
    dataset = IndexedRegression(RESUME_N, dtype=torch.float32)
    t.fit(module, DataLoader(dataset, batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    weights = [x for v in module.state_dict().values() for x in v.detach().reshape(-1).tolist()]
    return dict(history=cb.history, steps=record.steps, weights=weights)


@pytest.mark.timeout(400)
def test_a_mid_epoch_resume_continues_step_for_step(tmp_path, run_ok):
    whole = run_ok(_resumable_fit, 2, tmp_path / "whole", None, None, deadline_s=160)
    part = run_ok(_resumable_fit, 2, tmp_path / "part", STOP, None, deadline_s=160)
    path = tmp_path / "part" / f"step={STOP}.ckpt"
    assert path.is_dir()  # DeepSpeed's checkpoint: a folder
    assert part[0]["history"][-1]["samples_seen"] < RESUME_N  # inside the first epoch
    resumed = run_ok(_resumable_fit, 2, tmp_path / "resumed", None, path, deadline_s=160)
    before, after, history = part[0]["history"], resumed[0]["history"], whole[0]["history"]
    assert same(before, history[:STOP])
    assert [h["batch_size"] for h in after] == [h["batch_size"] for h in history[STOP:]]
    for key in history[0]:
        rest = [h[key] for h in history[STOP:]]
        assert [h[key] for h in after] == pytest.approx(rest, rel=1e-6, nan_ok=True), key
    assert steps_of(part) + steps_of(resumed) == steps_of(whole)  # the same samples, step for step
    assert resumed[0]["weights"] == whole[0]["weights"]  # bitwise


def _refused(rank: int, world: int, kwargs: dict, trainer_kwargs: dict) -> str:
    as_external_process(rank, world)
    t = trainer(devices=world, strategy=deepspeed(**kwargs), callbacks=[SimiGrad(0.5)], **trainer_kwargs)
    try:
        t.fit(Regressor(dtype=torch.float32), DataLoader(IndexedRegression(32, dtype=torch.float32), batch_size=4))
    except RuntimeError as error:
        return str(error)
    return ""


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "kwargs,trainer_kwargs,message",
    [
        (dict(stage=3), {}, r"ZeRO stages 1 and 2; this `DeepSpeedStrategy` runs stage 3.*stage=2"),
        (dict(stage=0), {}, r"runs stage 0"),
        (dict(stage=2, offload_optimizer=True), {}, r"`offload_optimizer`.*Leave offloading out"),
        (
            dict(stage=2),
            dict(precision="16-mixed"),
            r"precision='16-mixed'.*Use `precision='32-true'` or `'bf16-mixed'`",
        ),
        (dict(stage=2), dict(accumulate_grad_batches=4), r"accumulate_grad_batches=4.*Leave `accumulate_grad_batches`"),
    ],
)
def test_what_is_not_served_is_refused_before_the_first_step(kwargs, trainer_kwargs, message, run_ok):
    (error,) = run_ok(_refused, 1, kwargs, trainer_kwargs, deadline_s=160)
    assert re.search(message, error), error


def test_another_deepspeed_version_is_refused_with_the_one_to_install(monkeypatch):
    import deepspeed as installed

    from lightning_simigrad import _compat

    class Engine:  # the members the measurement reads, present: only the version is wrong
        optimizer = type("Zero", (), {m.name: None for m in _compat.DEEPSPEED_MEMBERS})()

    _compat.check_deepspeed(Engine())  # the installed one passes
    monkeypatch.setattr(installed, "__version__", "0.20.1")
    with pytest.raises(
        RuntimeError, match=r"read in DeepSpeed 0\.19; this is deepspeed 0\.20\.1.*deepspeed>=0\.19,<0\.20"
    ):
        _compat.check_deepspeed(Engine())
    monkeypatch.undo()
    Engine.optimizer = type("Zero", (), {})()
    with pytest.raises(RuntimeError, match=r"averaged_gradients"):
        _compat.check_deepspeed(Engine())

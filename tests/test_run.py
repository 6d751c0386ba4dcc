"""The step protocol of a Run, driven by hand: scripted statistics, hand-worked windows, no Trainer."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import SequentialSampler

from lightning_simigrad import HalfStats
from lightning_simigrad.core.sample_counts import Data, Limits
from lightning_simigrad.core.settings import Settings
from lightning_simigrad.data.sampler import AdaptiveBatchSampler
from lightning_simigrad.measurement import Measurement
from lightning_simigrad.run import Run
from lightning_simigrad.state.resume import Restart, Stage


class Scripted:
    """A measurement that hands back the statistics it is given, one per collected window, and logs its calls."""

    name = "scripted"
    min_micro_batches = 2  # measured like one process: the window's halves in time
    midpoint_reduction = False

    def __init__(self, *stats: HalfStats | None) -> None:
        self.stats = list(stats)
        self.calls: list[tuple] = []

    def attach(self, target):
        self.calls.append(("attach",))

    def start_micro_batch(self, window, index, params):
        self.calls.append(("start", index))

    def after_backward(self, window, index, fed, params):
        self.calls.append(("backward", index, fed))

    def half_of(self, window, index):
        return int(index >= window.half_split())

    def collect(self, loss_scale):
        self.calls.append(("collect", loss_scale))
        return self.stats.pop(0)

    def abort(self):
        self.calls.append(("abort",))

    def close(self):
        self.calls.append(("close",))


def stats(similarity: float) -> HalfStats:
    """Two unit halves at the given cosine, of 4 samples each."""
    return HalfStats(dot=similarity, sq_a=1.0, sq_b=1.0, n_a=4, n_b=4)


def make_run(measurement, samples=40, max_samples=None, restart=None, **settings) -> tuple[Run, list[list[int]]]:
    run = Run(
        Settings(target_similarity=0.5, max_micro_batch_size=4, max_samples=max_samples, **settings),
        Data(epoch_length=samples, batch_size=4, drop_last=False),
        Limits(),
        world_size=1,
        rank=0,
        seed=0,
        initial_batch_size=8,
        epoch=lambda: 0,
        measurement=measurement,
        restart=restart,
        warn=lambda message: None,
        info=lambda message: None,
    )
    sampler = AdaptiveBatchSampler(SequentialSampler(range(samples)), 4, False, schedule=run.schedule)
    return run, list(sampler)  # the sampler plans every window of the epoch as it yields


def train_step(run: Run, batches, params, skip=()) -> object:
    """One optimizer step: each micro-batch of the window started, backward (unless skipped), then finished."""
    while True:
        micro = run.start_micro_batch(params)
        batch = batches.pop(0)
        assert len(batch) == micro.local_samples
        if micro.index not in skip:
            params[0].grad = (params[0].grad if params[0].grad is not None else 0) + torch.ones(1) * len(batch)
            run.after_backward(params)
        if micro.last:
            return run.finish_step(params, loss_scale=None)


def test_a_step_plans_measures_decides_and_commits_in_order():
    measurement = Scripted(stats(0.0), stats(0.9))
    assert isinstance(measurement, Measurement)
    run, batches = make_run(measurement)
    params = [torch.nn.Parameter(torch.zeros(1))]
    run.start_epoch()
    first = train_step(run, batches, params)
    # B0 = 8 on one process with micro-batches of at most 4: two micro-batches of 4, one half each
    assert first.window.sizes == ((4,), (4,))
    assert measurement.calls == [
        ("start", 0),
        ("backward", 0, (4, 0)),
        ("start", 1),
        ("backward", 1, (4, 4)),
        ("collect", None),
    ]
    assert (first.index, first.samples, first.micro_batches, first.lr_factor) == (0, 8, 2, 1.0)
    assert first.stats == stats(0.0) and first.epoch_span == (0, 8) and first.total_span == (0, 8)
    # similarity 0 is below the target 0.5: the paper rule grows the batch to 8 x 1.1 = 8.8, asked as 9
    assert run.schedule.batch_size == 9 and run.controller.batch_size == 9
    # the sampler had planned the epoch ahead at 8; the next window is the one it planned
    second = train_step(run, batches, params)
    assert second.index == 1 and second.samples == 8 and second.total_span == (8, 16)
    assert run.schedule.batch_size == 8  # 8.8 x 0.9 = 7.92, asked as 8: similarity 0.9 is above the target
    assert (run.counts.steps, run.counts.samples_seen, run.counts.epoch_samples_done) == (2, 16, 16)


def test_the_loss_divisor_weighs_every_sample_by_one_over_the_window():
    run, batches = make_run(Scripted(stats(0.5)))
    micro = run.start_micro_batch([])
    assert micro.loss_divisor == 8 / (1 * 4)  # N / (W n): a mean over 4 samples weighs each 1/8


def test_a_skipped_micro_batch_leaves_the_step_a_mean_over_what_it_fed():
    run, batches = make_run(Scripted(None), lr_scaling="linear")
    params = [torch.nn.Parameter(torch.zeros(1))]
    step = train_step(run, batches, params, skip={1})
    assert step.samples == 4 and step.skipped_micro_batches and step.stats is None
    assert params[0].grad.item() == 4 * 8 / 4  # the fed half's gradient, rescaled from weight 4/8 to 1
    assert step.lr_factor == 4 / 8  # linear scaling of the 4 samples the step averaged, not the 8 planned
    assert run.schedule.batch_size == 8  # nothing measured: the controller holds


def test_the_budget_ends_the_fit_on_a_whole_step():
    run, batches = make_run(Scripted(stats(0.5), stats(0.5)), max_samples=12)
    params = [torch.nn.Parameter(torch.zeros(1))]
    # the second window is cut to the 4 samples left (the windows after it are never trained: the fit stops)
    assert [len(b) for b in batches[:4]] == [4, 4, 2, 2]
    train_step(run, batches, params)
    assert not run.done
    assert train_step(run, batches, params).samples == 4 and run.done and run.weight_left() == 0


def test_an_abandoned_window_is_aborted_at_the_epochs_end():
    measurement = Scripted()
    run, batches = make_run(measurement)
    run.start_micro_batch([])
    run.end_epoch()
    assert measurement.calls[-1] == ("abort",)
    run.close()
    assert measurement.calls[-1] == ("close",)


def test_a_checkpoints_state_puts_the_resumed_run_where_the_first_stood():
    run, batches = make_run(Scripted(stats(0.0), stats(0.0)))
    params = [torch.nn.Parameter(torch.zeros(1))]
    train_step(run, batches, params)
    state = run.state_dict()
    assert state["schedule"]["planned"] == [8, 8, 8, 8]  # the windows planned ahead at 8, not yet trained
    restart = Restart(path="x.ckpt", state=state, epoch=0, at_epoch_end=False, batches_into_epoch=2, global_step=1)
    resumed, resumed_batches = make_run(Scripted(stats(0.0)), restart=restart)
    counts = resumed.counts
    assert (counts.steps, counts.samples_seen, counts.epoch_samples_done) == (1, 8, 8)
    assert resumed.controller.state_dict() == run.controller.state_dict()
    assert resumed_batches == batches  # the rest of the epoch, in the same windows
    assert resumed.resumption.stage is Stage.FRESH  # the state has no generator states to restore


def test_a_checkpoint_without_simigrads_state_counts_its_steps_as_steps_of_b0():
    restart = Restart(path="x.ckpt", state=None, epoch=1, at_epoch_end=False, batches_into_epoch=0, global_step=5)
    messages = []
    run = Run(
        Settings(target_similarity=0.5),
        Data(40, 4, False),
        Limits(),
        1,
        0,
        0,
        8,
        epoch=lambda: 1,
        measurement=Scripted(),
        restart=restart,
        warn=messages.append,
    )
    assert run.without_state and (run.counts.steps, run.counts.samples_seen) == (5, 40)
    assert "has no SimiGrad state" in messages[0]


def test_max_steps_counts_steps_of_b0_samples():
    run, _ = make_run(Scripted())
    assert run.weight_left() == math.inf
    limited = Run(
        Settings(target_similarity=0.5), Data(40, 4, False), Limits(max_steps=3), 1, 0, 0, 8, lambda: 0, Scripted()
    )
    assert limited.weight_left() == 24 and limited.bounds.fit_length().stepping_batches == 3


def test_a_batch_bound_below_what_a_measurement_needs_is_refused():
    with pytest.raises(ValueError, match=r"`max_batch_size` \(1\) is below the 2 samples a measurement needs"):
        settings = Settings(target_similarity=0.5, max_batch_size=1)
        Run(settings, Data(40, 4, False), Limits(), 1, 0, 0, 1, lambda: 0, Scripted())


@pytest.mark.parametrize("midpoint_reduction", [False, True])
def test_only_the_last_micro_batch_of_a_first_half_reduces_and_only_when_the_measurement_asks(midpoint_reduction):
    measurement = Scripted(*[stats(0.5)] * 3)
    measurement.midpoint_reduction = midpoint_reduction
    run, batches = make_run(measurement, samples=60)
    params = [torch.nn.Parameter(torch.zeros(1))]
    for _ in range(2):
        marks = []
        while True:
            micro = run.start_micro_batch(params)
            batches.pop(0)
            marks.append(micro.reduces)
            params[0].grad = torch.ones(1)
            run.after_backward(params)
            if micro.last:
                run.finish_step(params, loss_scale=None)
                break
        # a window of 2 micro-batches (B0 = 8), then of 3 (9 samples): the first half is micro-batches 0..k/2-1
        half = micro.window.half_split()
        assert len(marks) == micro.window.num_micro_batches >= 2
        assert marks == [midpoint_reduction and i == half - 1 for i in range(len(marks))]


def test_a_checkpoint_without_simigrads_state_counts_its_steps_in_samples_and_in_tokens():
    """Counted in tokens, the fixed-batch run's 5 steps of B0 = 80 tokens are 400 tokens, and about 400 / 10 samples
    at the data's 10 tokens a sample, not 400 samples."""
    restart = Restart(path="x.ckpt", state=None, epoch=1, at_epoch_end=False, batches_into_epoch=0, global_step=5)
    lengths = torch.full((40,), 10, dtype=torch.int64)
    data = Data(40, 4, False, weights=lengths, weight=400)
    settings = Settings(target_similarity=0.5, lengths=lengths.tolist(), initial_batch_size=80)
    run = Run(settings, data, Limits(), 1, 0, 0, 80, lambda: 1, Scripted(), restart=restart, warn=lambda _: None)
    assert (run.counts.steps, run.counts.weight_seen, run.counts.samples_seen) == (5, 400, 40)

"""The adaptive batch sampler on its own: shards, tails, resume offsets and the orders it refuses."""

from __future__ import annotations

import pytest
from torch.utils.data import RandomSampler, SequentialSampler, WeightedRandomSampler

from lightning_simigrad import AdaptiveBatchSampler, WindowSchedule
from lightning_simigrad.data.schedule import ResumePoint

DATA = list(range(103))


def rank_samplers(world: int, batch_size: int = 20, micro: int = 4, drop_last: bool = False, seed: int = 7):
    samplers = []
    for rank in range(world):
        schedule = WindowSchedule(batch_size=batch_size, max_micro_batch_size=micro, world_size=world, seed=seed)
        samplers.append(AdaptiveBatchSampler(RandomSampler(DATA), 4, drop_last, schedule=schedule, rank=rank))
    return samplers


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_together_feed_every_sample_once(world):
    samplers = rank_samplers(world)
    batches = [list(s) for s in samplers]
    assert len({len(b) for b in batches}) == 1  # every rank runs the same number of micro-batches
    seen = []
    for rank, (sampler, micro_batches) in enumerate(zip(samplers, batches)):
        planned = [w.sizes[j][rank] for w in sampler.schedule.current.windows for j in range(w.num_micro_batches)]
        assert [len(m) for m in micro_batches] == [max(n, 1) for n in planned]
        # a rank left without a sample in a tiny tail feeds one zero-weight padding sample: not counted
        seen += [i for m, n in zip(micro_batches, planned) if n for i in m]
    assert sorted(seen) == DATA
    assert max(len(m) for b in batches for m in b) <= 4


def test_the_order_is_shuffled_per_epoch_and_reproducible():
    (a,), (b,) = rank_samplers(1), rank_samplers(1)
    assert list(a) == list(b)
    a.schedule.epoch = lambda: 1
    assert [i for m in a for i in m] != [i for m in b for i in m]


def test_drop_last_drops_only_a_tail_smaller_than_the_window():
    (sampler,) = rank_samplers(1, batch_size=20, drop_last=True)
    seen = [i for m in sampler for i in m]
    assert len(seen) == 100  # 103 = 5 windows of 20 + a tail of 3


def test_a_resume_offset_skips_exactly_the_completed_windows():
    (whole,) = rank_samplers(1)
    (resumed,) = rank_samplers(1)
    resumed.schedule.resume_from = ResumePoint(0, 40)
    order = [i for m in whole for i in m]
    assert [i for m in resumed for i in m] == order[40:]


def test_a_resume_plans_the_pending_windows_before_the_current_batch_size():
    (resumed,) = rank_samplers(1, batch_size=20)
    resumed.schedule.resume_from = ResumePoint(0, 10, planned=(7, 12))
    list(resumed)
    # 103 - 10 = 93 samples: the two windows planned before the checkpoint, then windows of 20, a tail of 14
    assert [w.total for w in resumed.schedule.current.windows] == [7, 12, 20, 20, 20, 14]
    assert list(resumed.schedule.current.requests) == [7, 12, 20, 20, 20, 20]


def test_the_plan_keeps_only_windows_training_has_not_finished():
    (sampler,) = rank_samplers(1, batch_size=20, micro=10)
    batches = iter(sampler)
    next(batches)  # the sampler starts a window of 20 in 2 micro-batches of 10
    plan = sampler.schedule.current
    assert plan.pending == [20]
    assert not plan.inside_window  # planned, not started
    plan.next_micro_batch(), plan.next_micro_batch()  # training feeds both micro-batches
    assert plan.inside_window
    plan.commit()  # ... and steps
    assert plan.pending == [] and not plan.inside_window
    next(batches), next(batches)  # the DataLoader draws the next window ahead
    assert plan.pending == [20]
    window, micro = plan.next_micro_batch()
    assert (window.total, micro, len(plan.windows)) == (20, 0, 1)  # the trained window is dropped


def test_the_sampler_has_no_length():
    (sampler,) = rank_samplers(1)
    with pytest.raises(TypeError):
        len(sampler)


@pytest.mark.parametrize(
    "sampler",
    [
        RandomSampler(DATA, replacement=True),
        WeightedRandomSampler([1.0] * 103, 103),
        RandomSampler(DATA, num_samples=50),
    ],
)
def test_ddp_refuses_orders_ranks_cannot_regenerate(sampler):
    schedule = WindowSchedule(batch_size=20, max_micro_batch_size=4, world_size=2)
    with pytest.raises(ValueError, match="RandomSampler without replacement or a SequentialSampler"):
        AdaptiveBatchSampler(sampler, 4, False, schedule=schedule)


def test_one_process_follows_a_foreign_order():
    schedule = WindowSchedule(batch_size=10, max_micro_batch_size=5, min_micro_batches=2)
    weighted = WeightedRandomSampler([1.0] * 103, 103)
    assert sum(len(m) for m in AdaptiveBatchSampler(weighted, 5, False, schedule=schedule)) == 103
    sequential = AdaptiveBatchSampler(SequentialSampler(DATA), 5, False, schedule=schedule)
    assert [i for m in sequential for i in m] == DATA


@pytest.mark.parametrize("world", [1, 3])
def test_the_epochs_last_two_windows_share_a_tail_that_would_be_below_half_a_window(world):
    samplers = rank_samplers(world, batch_size=20)
    batches = [list(s) for s in samplers]
    seen = [i for rank, s in enumerate(samplers) for m, n in zip(batches[rank], _slots(s, rank)) if n for i in m]
    assert sorted(seen) == DATA  # still every sample once
    # 103 = 4 x 20 + 23: a window of 20 would leave 3, so the last two share the 23
    assert [w.total for w in samplers[0].schedule.current.windows] == [20, 20, 20, 20, 12, 11]


def _slots(sampler, rank):
    """This rank's planned sizes, micro-batch by micro-batch (valid once the sampler has been iterated)."""
    return [w.sizes[j][rank] for w in sampler.schedule.current.windows for j in range(w.num_micro_batches)]


def test_a_tail_of_half_a_window_or_more_is_left_alone():
    (sampler,) = rank_samplers(1, batch_size=30)  # 103 = 3 x 30 + 13: 13 < 15, shared; at 34, 103 = 3 x 34 + 1
    list(sampler)
    assert [w.total for w in sampler.schedule.current.windows] == [30, 30, 22, 21]
    (sampler,) = rank_samplers(1, batch_size=40)  # 103 = 2 x 40 + 23: 23 >= 20, left alone
    list(sampler)
    assert [w.total for w in sampler.schedule.current.windows] == [40, 40, 23]


def test_a_resume_between_the_shared_windows_plans_the_same_last_window():
    (whole,) = rank_samplers(1, batch_size=20)
    order = [i for m in whole for i in m]
    (resumed,) = rank_samplers(1, batch_size=20)
    # the checkpoint was written after the first shared window (80 + 12 samples); the last was planned with 11
    resumed.schedule.resume_from = ResumePoint(0, 92, planned=tuple(whole.schedule.current.requests)[5:])
    resumed.schedule.batch_size = 5  # the controller has moved since: the planned window is kept
    assert [i for m in resumed for i in m] == order[92:]
    assert [w.total for w in resumed.schedule.current.windows] == [11]


def test_after_a_shrink_the_tail_is_taken_whole_rather_than_shared_below_half_the_step_before():
    (sampler,) = rank_samplers(1, batch_size=52, micro=64)
    batches = iter(sampler)
    next(batches)  # the window of 52 (one micro-batch)
    sampler.schedule.batch_size = 40  # the controller shrinks: 51 left; shares of 26 and 25 would be below 52 / 2
    rest = list(batches)
    assert [w.total for w in sampler.schedule.current.windows] == [52, 51]
    assert sum(len(m) for m in rest) == 51

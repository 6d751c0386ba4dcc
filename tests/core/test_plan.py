import itertools

import pytest

from lightning_simigrad.core.plan import min_window, plan_window


@pytest.mark.parametrize(
    "batch_size,available,world,micro,min_k,even",
    list(
        itertools.product(
            [1, 2, 3, 7, 64, 65, 100, 127, 128, 129, 1000, 4097],
            [5, 10_000],
            [1, 2, 3, 4],
            [1, 8, 64],
            [1, 2],
            [False, True],
        )
    ),
)
def test_plans_are_exact_balanced_and_bounded(batch_size, available, world, micro, min_k, even):
    w = plan_window(batch_size, available, world, micro, min_k, even)
    n = min(batch_size, available)
    if available - n < min_window(world, min_k):
        n = available  # the epoch's last few samples join the window before them
    assert w.total == n  # exactly the requested size: no rounding to world x micro x steps
    assert w.world_size == world
    flat = [s for m in w.sizes for s in m]
    assert max(flat) - min(flat) <= 1
    if n >= world * w.num_micro_batches:
        assert min(flat) >= 1
    # no one-sample slot (BatchNorm refuses them) where the window has two per rank and the cap allows
    if micro >= 3 and n >= 2 * world:
        assert min(flat) >= 2
    # the micro-batch bound holds unless the window is too small to give every rank a sample per micro-batch
    assert w.max_micro_batch_size <= micro or w.num_micro_batches == max(1, n // world)
    if n >= min_window(world, min_k):
        assert w.num_micro_batches >= min_k
    if even and w.num_micro_batches % 2:
        # odd only where more micro-batches would leave slots of one sample
        assert w.num_micro_batches == max(1, n // (world * min(2, micro))) or w.num_micro_batches == 1


def test_a_small_remainder_joins_the_window_unless_drop_last_drops_it():
    assert plan_window(16, 19, 1, 8, min_micro_batches=2).total == 19  # 3 left: too few to measure
    assert plan_window(16, 20, 1, 8, min_micro_batches=2).total == 16  # 4 left: a window of their own
    assert plan_window(16, 19, 1, 8, min_micro_batches=2, take_small_remainder=False).total == 16
    assert plan_window(100, 107, 4, 64).total == 107  # under DDP: fewer than 2 per rank left


@pytest.mark.parametrize("tail", [1, 2, 3, 5, 7])
def test_a_tail_is_never_fed_as_one_sample_micro_batches(tail):
    # plain Lightning with batch_size=16 feeds a tail of 2..15 as one micro-batch: so must we
    w = plan_window(32, tail, world_size=1, max_micro_batch_size=16, min_micro_batches=2, even_micro_batches=True)
    assert min(s for m in w.sizes for s in m) >= min(tail, 2)


def test_offsets_tile_the_window():
    w = plan_window(301, 10_000, 3, 16)
    seen = []
    for j in range(w.num_micro_batches):
        for r in range(3):
            seen.extend(range(w.offset(j, r), w.offset(j, r) + w.sizes[j][r]))
    assert seen == list(range(301))
    assert sum(w.samples_per_rank()) == 301


def test_two_equal_halves_on_one_process():
    w = plan_window(1000, 10_000, 1, 128, min_micro_batches=2, even_micro_batches=True)
    assert w.num_micro_batches == 8  # ceil(1000 / 128) = 8
    half = w.half_split()
    assert sum(m[0] for m in w.sizes[:half]) == 500
    w = plan_window(130, 10_000, 1, 64, min_micro_batches=2, even_micro_batches=True)
    assert w.num_micro_batches == 4  # 3 rounded up to even
    assert w.total == 130


def test_empty_window_is_an_error():
    with pytest.raises(ValueError):
        plan_window(10, 0, 1, 4)

"""Windows planned in tokens (lightning_simigrad.core.token_plan): every sample of the window exactly once, every
slot within the padded-token and sample caps, a k x W grid with the micro-batches a measurement needs, the slots'
weights their unpadded tokens, samples of alike length together, and halves of alike lengths."""

from __future__ import annotations

import random

import pytest

from lightning_simigrad.core.token_plan import padded_tokens, plan_token_window


def slots(window, lengths):
    for micro in range(window.num_micro_batches):
        for rank in range(window.world_size):
            yield micro, rank, [lengths[i] for i in window.slot_positions(micro, rank)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(20))
def test_every_sample_once_within_the_caps(world: int, seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 512) for _ in range(rng.randint(world * 2, 300))]
    cap_tokens, cap_samples = rng.choice([512, 1024, 4096]), rng.choice([4, 16, 10**9])
    window = plan_token_window(lengths, world, cap_tokens, cap_samples, min_micro_batches=2 if world == 1 else 1,
                               even_micro_batches=world == 1)  # fmt: skip
    assert sorted(window.order) == list(range(len(lengths)))  # each sample once
    assert window.weight == sum(lengths)
    for micro, rank, slot in slots(window, lengths):
        assert padded_tokens(slot) <= cap_tokens and len(slot) <= cap_samples
        assert window.weights[micro][rank] == sum(slot)
        assert slot  # enough samples for every slot here
    if world == 1 and len(lengths) >= 4:
        assert window.num_micro_batches >= 2 and window.num_micro_batches % 2 == 0


def test_the_fewest_micro_batches_the_caps_allow_and_grouped_lengths() -> None:
    lengths = [100, 10, 90, 12, 95, 11, 8, 105]
    window = plan_token_window(lengths, 1, max_micro_batch_tokens=220, max_micro_batch_size=64)
    # longest first: [105, 100] [95, 90] then the short ones together: three micro-batches
    grouped = sorted(sorted(slot) for _, _, slot in slots(window, lengths))
    assert grouped == [[8, 10, 11, 12], [90, 95], [100, 105]]
    plain = [lengths[i : i + 3] for i in range(0, 8, 3)]  # the same samples in their order, three to a batch
    assert sum(padded_tokens(s) for _, _, s in slots(window, lengths)) < sum(padded_tokens(s) for s in plain)


def test_the_halves_see_alike_lengths() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 512) for _ in range(400)]
    window = plan_token_window(lengths, 1, 2048, 10**9, min_micro_batches=2, even_micro_batches=True)
    half = window.half_split()
    first = [t for micro, _, slot in slots(window, lengths) if micro < half for t in slot]
    second = [t for micro, _, slot in slots(window, lengths) if micro >= half for t in slot]
    mean = sum(lengths) / len(lengths)
    # sorted halves would differ by about half the mean; dealt alternately, by a few percent
    assert abs(sum(first) / len(first) - sum(second) / len(second)) < 0.1 * mean
    ranks = plan_token_window(lengths, 2, 2048, 10**9)
    a = [t for _, rank, slot in slots(ranks, lengths) if rank == 0 for t in slot]
    b = [t for _, rank, slot in slots(ranks, lengths) if rank == 1 for t in slot]
    assert abs(sum(a) / len(a) - sum(b) / len(b)) < 0.1 * mean


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_window_of_one_run_splits_into_halves_of_alike_tokens(world: int) -> None:
    # the whole window fits one micro-batch's bound: it is one run, split for the halves (and the ranks); cut in
    # the middle of its sorted order, one half held the long sequences: 643 tokens against 170 (W = 1)
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(40 * world)]
    window = plan_token_window(lengths, world, 4096, 10**9, min_micro_batches=2, even_micro_batches=world == 1)
    if world == 1:
        half = window.half_split()
        parts = [sum(t for m, _, s in slots(window, lengths) if (m >= half) == b for t in s) for b in (False, True)]
    else:  # DDP's rank groups: the first floor(W / 2) ranks against the rest, per rank
        parts = [sum(t for _, r, s in slots(window, lengths) if r == rank for t in s) for rank in range(world)]
    assert max(parts) - min(parts) <= max(lengths) - min(lengths)  # within one sequence's spread, not a sort
    assert max(parts) < 1.1 * min(parts)


def test_more_slots_than_samples_leaves_a_slot_empty() -> None:
    # three sequences that each fill a micro-batch, on two ranks: two micro-batches, one slot empty
    window = plan_token_window([50, 50, 50], 2, max_micro_batch_tokens=50, max_micro_batch_size=8)
    assert window.num_micro_batches == 2 and sorted(s for row in window.sizes for s in row) == [0, 1, 1, 1]
    assert window.weight == 150

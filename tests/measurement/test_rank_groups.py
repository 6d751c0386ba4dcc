"""RankGroupMeasurement on real gloo process groups (W = 2, 3, 4), started on loopback.

Each test starts W processes (`distributed.run_ok`, under a deadline); the checks run inside them and a
failure comes back as that rank's traceback.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_simigrad.measurement import MeasurementError, RankGroupMeasurement, loss_scale_of
from lightning_simigrad.testing import HostSyncs, flat_grad, reference_halves, run_window

BUCKET_CAP_MB = 1e-5  # ~10 bytes: (after the rebuild) one bucket per parameter tensor


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)
    )


def _window(rank: int, world_size: int, seed: int) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """All ranks' sample counts (rank r gets 5 + r, shifted per window) and this rank's micro-batches."""
    counts = [5 + r + seed % 2 for r in range(world_size)]
    n = counts[rank]
    sizes = [2, 2, n - 4]  # three micro-batches of unequal size
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(n, 6, generator=gen)
    y = torch.randn(n, 3, generator=gen)
    # Correlated targets between ranks keep the similarity away from 0 (and the check meaningful).
    y = y + torch.sin(x[:, :3]) * 3.0
    micro, start = [], 0
    for size in sizes:
        micro.append((x[start : start + size], y[start : start + size]))
        start += size
    return counts, micro


def _check_measurement(rank: int, world_size: int) -> None:
    groups_before = len(dist.distributed_c10d._world.pg_map)
    for gradient_as_bucket_view in (False, True):
        base = _mlp()
        plain = DDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB)
        hooked = DDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=gradient_as_bucket_view)
        local = copy.deepcopy(base)  # no DDP: its grads are this rank's h_r
        measurement = RankGroupMeasurement()
        measurement.register(hooked)
        assert [measurement.group_of(r) for r in range(world_size)] == [
            0 if r < world_size // 2 else 1 for r in range(world_size)
        ]
        # Everything runs on DDP's own group: no subgroup, no second communicator.
        assert len(dist.distributed_c10d._world.pg_map) == groups_before
        optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
        for window in range(4):
            armed = window != 1  # window 1 is an unarmed sync: plain averaging, collect() -> None
            counts, micro = _window(rank, world_size, window)
            for model in (plain, hooked, local):
                model.zero_grad(set_to_none=True)
            with HostSyncs("cpu") as plain_reads:
                run_window(plain, micro, counts, world_size)
            run_window(local, micro, counts, world_size)
            if armed:
                measurement.arm(counts)
            with HostSyncs("cpu") as hooked_reads:
                run_window(hooked, micro, counts, world_size)
            assert hooked_reads.count == plain_reads.count  # the hook reads nothing back to the host

            # Gradients are exactly plain DDP's (same reduction arithmetic), on every rank.
            for p_plain, p_hooked in zip(plain.parameters(), hooked.parameters(), strict=True):
                assert torch.equal(p_plain.grad, p_hooked.grad), (window, gradient_as_bucket_view)
            if window >= 2:  # after DDP's bucket rebuild (first iteration) the tiny cap gives many
                assert measurement.halves._measured is not None and measurement.halves._measured.num_buckets >= 3

            loss_scale = torch.tensor(2.0) if window == 3 else None  # a GradScaler's scale, as a tensor
            with HostSyncs("cpu") as collect_reads:
                stats = measurement.collect(loss_scale=loss_scale)
            assert collect_reads.count == (1 if armed else 0)  # one host synchronisation per step
            if stats is not None and loss_scale is not None:
                stats = stats.scaled(2.0)  # the statistics came divided by the scale: 2^2, exactly
            reference = reference_halves(flat_grad(local), counts)
            if not armed:
                assert stats is None
            else:
                assert stats is not None
                dot, sq_a, sq_b = reference
                size_a = world_size // 2
                assert (stats.n_a, stats.n_b) == (sum(counts[:size_a]), sum(counts[size_a:]))
                scale = (sq_a * sq_b) ** 0.5
                assert abs(stats.dot - dot) <= 1e-6 * scale, (stats.dot, dot)
                assert stats.sq_a == pytest.approx(sq_a, rel=1e-6)
                assert stats.sq_b == pytest.approx(sq_b, rel=1e-6)
                assert stats.similarity == pytest.approx(dot / scale, abs=1e-6)
                assert stats.is_finite and abs(stats.similarity) < 0.999, stats  # non-degenerate halves
                # Bitwise the same on every rank.
                mine = torch.tensor([stats.dot, stats.sq_a, stats.sq_b], dtype=torch.float64)
                everyone = [torch.empty_like(mine) for _ in range(world_size)]
                dist.all_gather(everyone, mine)
                assert all(torch.equal(mine, other) for other in everyone)
            assert measurement.collect() is None  # collect() disarmed

            optimizer.step()  # keep the three copies identical for the next window
            with torch.no_grad():
                for p_plain, p_hooked, p_local in zip(
                    plain.parameters(), hooked.parameters(), local.parameters(), strict=True
                ):
                    p_hooked.copy_(p_plain)
                    p_local.copy_(p_plain)

        measurement.close()
        measurement.close()  # idempotent
        # After close the hook only averages, still like plain DDP.
        counts, micro = _window(rank, world_size, 7)
        for model in (plain, hooked):
            model.zero_grad(set_to_none=True)
            run_window(model, micro, counts, world_size)
        assert torch.equal(flat_grad(plain), flat_grad(hooked))
        with pytest.raises(RuntimeError, match="closed"):
            measurement.arm(counts)
    assert len(dist.distributed_c10d._world.pg_map) == groups_before  # no stray subgroups


@pytest.mark.timeout(120)  # beside the group's own deadline
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_matches_plain_ddp_and_reference(world_size: int, run_ok) -> None:
    run_ok(_check_measurement, world_size)


def _check_refusals(rank: int, world_size: int) -> None:
    measurement = RankGroupMeasurement()
    assert measurement.collect() is None  # nothing armed

    # A user's Python comm hook, and a built-in (C++) one, are both detected.
    user_hooked = DDP(_mlp())
    user_hooked.register_comm_hook(state=None, hook=default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="already has a communication hook.*allreduce_hook"):
        measurement.register(user_hooked)
    builtin_hooked = DDP(_mlp())
    builtin_hooked._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    with pytest.raises(RuntimeError, match="already has a communication hook"):
        measurement.register(builtin_hooked)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        measurement.register(_mlp())  # type: ignore[arg-type]

    model = DDP(_mlp())
    with pytest.raises(RuntimeError, match="register"):
        measurement.arm([1] * world_size)
    measurement.register(model)
    with pytest.raises(RuntimeError, match="already registered"):
        measurement.register(model)
    with pytest.raises(RuntimeError, match="already has a communication hook.*simigrad"):
        RankGroupMeasurement().register(model)  # a second measurement on the same model

    with pytest.raises(ValueError, match="one count per rank"):
        measurement.arm([1] * (world_size + 1))
    with pytest.raises(ValueError, match="non-negative"):
        measurement.arm([-1] + [1] * (world_size - 1))
    with pytest.raises(ValueError, match="Both rank groups"):
        measurement.arm([0] * (world_size // 2) + [1] * (world_size - world_size // 2))
    measurement.arm([1] * world_size)
    with pytest.raises(MeasurementError, match="before a synchronising backward"):
        measurement.collect()  # armed, but no backward ran: every rank raises, after the all-gather
    assert measurement.collect() is None
    measurement.close()


@pytest.mark.timeout(120)  # beside the group's own deadline
def test_refusals(run_ok) -> None:
    run_ok(_check_refusals, 2)


def _check_low_precision(rank: int, world_size: int, dtype: torch.dtype) -> float:
    """bf16/fp16 buckets: products accumulated in float32 and wider; the similarity's error against float64."""
    base = _mlp().to(dtype)
    plain = DDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB)
    hooked = DDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB)
    local = copy.deepcopy(base)
    measurement = RankGroupMeasurement()
    measurement.register(hooked)
    worst = 0.0
    for window in range(3):  # after DDP's bucket rebuild too
        counts, micro = _window(rank, world_size, window)
        micro = [(x.to(dtype), y.to(dtype)) for x, y in micro]
        for model in (plain, hooked, local):
            model.zero_grad(set_to_none=True)
        for model in (plain, local):
            run_window(model, micro, counts, world_size)
        measurement.arm(counts)
        run_window(hooked, micro, counts, world_size)
        assert torch.equal(flat_grad(plain), flat_grad(hooked))
        stats = measurement.collect()
        assert stats is not None and stats.is_finite
        # The reference sums every rank's own (pre-division) gradient in float64: what the halves are.
        dot, sq_a, sq_b = reference_halves(flat_grad(local), counts)
        worst = max(worst, abs(stats.similarity - dot / (sq_a * sq_b) ** 0.5))
        assert stats.sq_a == pytest.approx(sq_a, rel=1e-2)
        assert stats.sq_b == pytest.approx(sq_b, rel=1e-2)
    measurement.close()
    return worst


@pytest.mark.timeout(120)  # beside the group's own deadline
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_low_precision_gradients(world_size: int, dtype: torch.dtype, run_ok) -> None:
    errors = run_ok(_check_low_precision, world_size, dtype)
    assert max(errors) < 1e-3, errors


def _check_low_similarity(rank: int, world_size: int) -> None:
    """Nearly orthogonal halves: at W = 2 u.o comes from |g|^2 - u.u - o.o, a difference of squares."""
    torch.manual_seed(0)
    base = torch.nn.Linear(256, 64, bias=False)
    plain = DDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB)
    hooked = DDP(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB)
    local = copy.deepcopy(base)
    measurement = RankGroupMeasurement()
    measurement.register(hooked)
    counts = [8] * world_size
    gen = torch.Generator().manual_seed(rank)
    # A loss linear in the output with independent random weights: every rank's gradient is an
    # independent zero-mean random matrix, so the halves' cosine is ~ 1/sqrt(256 * 64 / 8).
    x, y = torch.randn(8, 256, generator=gen), torch.randn(8, 64, generator=gen)
    for window in range(2):  # the second window runs after DDP's bucket rebuild
        for model in (plain, hooked, local):
            model.zero_grad(set_to_none=True)
        weight = world_size / sum(counts)
        for model in (plain, local):
            ((model(x) * y).sum() * weight).backward()
        measurement.arm(counts)
        ((hooked(x) * y).sum() * weight).backward()
        assert torch.equal(flat_grad(plain), flat_grad(hooked))
        stats = measurement.collect()
        assert stats is not None
        dot, sq_a, sq_b = reference_halves(flat_grad(local), counts)
        scale = (sq_a * sq_b) ** 0.5
        assert abs(dot / scale) < 0.1, dot / scale  # the case this test is about
        assert abs(stats.dot - dot) <= 1e-6 * scale, (window, stats.dot, dot)
        assert stats.sq_a == pytest.approx(sq_a, rel=1e-6)
        assert stats.sq_b == pytest.approx(sq_b, rel=1e-6)
    measurement.close()


@pytest.mark.timeout(120)  # beside the group's own deadline
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_low_similarity(world_size: int, run_ok) -> None:
    run_ok(_check_low_similarity, world_size)


def test_the_loss_scale_is_read_with_the_rows_in_one_transfer() -> None:
    from lightning_simigrad.exchange import read_rows as _fetch

    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert loss_scale_of(scaler) == 8.0  # before its first step the scaler has no tensor yet
    scaler.scale(torch.ones(()))  # now it holds its scale as a tensor: read without a synchronisation
    scale = loss_scale_of(scaler)
    assert isinstance(scale, torch.Tensor) and scale.item() == 8.0
    assert loss_scale_of(torch.amp.GradScaler("cpu", enabled=False)) is None
    rows = torch.arange(12, dtype=torch.float64).view(2, 6)
    with HostSyncs("cpu") as reads:
        values, value = _fetch(rows, scale)
    assert reads.count == 1 and value == 8.0 and values == rows.tolist()
    assert _fetch(rows, None) == (rows.tolist(), 1.0)

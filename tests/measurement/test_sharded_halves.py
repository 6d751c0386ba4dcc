"""The FSDP2 measurement through its protocol, on real gloo groups: the window's halves in time on gradient shards.

Each rank trains a ``fully_shard``-ed model on its own samples of every micro-batch, weighted as SimiGrad weighs
them (each sample of the window by 1/N after FSDP2's mean over the ranks); the statistics are compared with
float64 gradients of an unsharded copy over exactly the samples of each half, on every rank.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_simigrad import MeasurementError, Window
from lightning_simigrad.measurement import Measurement, sharded_halves
from lightning_simigrad.measurement.sharding import check_sharding

pytest.importorskip("torch.distributed.fsdp")

# slot sizes[j][r] for up to 4 ranks; an odd number of micro-batches: halves of unequal sizes
SIZES = ((3, 2, 4, 1), (2, 5, 1, 3), (4, 1, 2, 2))


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _data(world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """data[j][r]: the inputs and targets of slot (j, r), the same on every rank."""
    g = torch.Generator().manual_seed(1)
    return [
        [(torch.randn(row[r], 5, generator=g), torch.randn(row[r], 3, generator=g)) for r in range(world)]
        for row in SIZES
    ]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum()  # a sum over samples: the weights below make it a mean


def _reference(model: nn.Module, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The float64 gradient of the mean loss over the samples of ``pieces``."""
    copy = _model().double()
    copy.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    x = torch.cat([p[0] for p in pieces]).double()
    y = torch.cat([p[1] for p in pieces]).double()
    (_loss(copy, x, y) / len(x)).backward()
    return torch.cat([p.grad.reshape(-1) for p in copy.parameters()])


def _shard(world: int, bf16: bool = False) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mp_policy": policy} if policy is not None else {}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _accumulate(rank: int, world: int, model: nn.Module, window: Window, micro_batches: range, data) -> torch.Tensor:
    """The full gradient a sharded model accumulates over ``micro_batches`` of the window (no measurement)."""
    for j in micro_batches:
        x, y = data[j][rank]
        (_loss(model, x, y) * world / window.total).backward()
    return torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()]).double()


def _mixed_precision(rank: int, world: int) -> dict:
    """bf16 compute, fp32 reduction: the statistics against the half sums FSDP2 itself accumulates."""
    window = Window(tuple(row[:world] for row in SIZES))
    data, split = _data(world), window.half_split()
    s = _accumulate(rank, world, _shard(world, bf16=True), window, range(split), data)
    r = _accumulate(rank, world, _shard(world, bf16=True), window, range(split, window.num_micro_batches), data)
    model = _shard(world, bf16=True)
    params, measurement, fed = list(model.parameters()), sharded_halves(), [0, 0]
    for j in range(window.num_micro_batches):
        measurement.start_micro_batch(window, j, params)
        x, y = data[j][rank]
        (_loss(model, x, y) * world / window.total).backward()
        fed[j >= split] += sum(window.sizes[j])
        measurement.after_backward(window, j, (fed[0], fed[1]), params)
    stats = measurement.collect(loss_scale=None)
    joined = torch.cat([p.grad.full_tensor().reshape(-1) for p in params]).double()
    n_a, n_b = fed
    g_a, g_b = s * window.total / n_a, r * window.total / n_b
    return dict(
        stats=(stats.dot, stats.sq_a, stats.sq_b),
        reference=(float(g_a @ g_b), float(g_a @ g_a), float(g_b @ g_b)),
        dtypes={str(p.grad.dtype) for p in params},
        join_error=float((joined - (s + r)).norm() / (s + r).norm()),
    )


def _window(rank: int, world: int, fail_on: int | None = None) -> dict:
    """One window through the measurement on this rank; its statistics (or error) and the references."""
    plain = _model()
    model = _shard(world)
    window = Window(tuple(row[:world] for row in SIZES))
    data = _data(world)
    measurement = sharded_halves()
    assert isinstance(measurement, Measurement)
    if rank == fail_on:  # a fault inside the measurement's arithmetic on this rank only

        def broken(grad: torch.Tensor) -> torch.Tensor:
            raise ValueError("injected fault")

        measurement.halves.pieces.storage = broken  # type: ignore[method-assign]
    params = list(model.parameters())
    check_sharding(params, world)
    fed = [0, 0]
    for j in range(window.num_micro_batches):
        measurement.start_micro_batch(window, j, params)
        x, y = data[j][rank]
        # FSDP2 averages over the ranks: a per-rank weight W / N makes every sample of the window weigh 1 / N
        (_loss(model, x, y) * world / window.total).backward()
        fed[j >= window.half_split()] += sum(window.sizes[j])
        measurement.after_backward(window, j, (fed[0], fed[1]), params)
    try:
        stats = measurement.collect(loss_scale=None)
    except MeasurementError as error:
        return dict(error=str(error), cause=repr(error.__cause__))
    full = torch.cat([p.grad.full_tensor().reshape(-1) for p in params]).double()  # a collective, on every rank
    split = window.half_split()
    g_a = _reference(plain, [piece for row in data[:split] for piece in row])
    g_b = _reference(plain, [piece for row in data[split:] for piece in row])
    g = _reference(plain, [piece for row in data for piece in row])
    return dict(
        stats=(stats.dot, stats.sq_a, stats.sq_b, stats.n_a, stats.n_b),
        reference=(float(g_a @ g_b), float(g_a @ g_a), float(g_b @ g_b)),
        halves=(sum(map(sum, window.sizes[:split])), sum(map(sum, window.sizes[split:]))),
        grad_error=float((full - g).norm() / g.norm()),
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_halves_equal_float64_references_and_leave_the_mean_gradient(world, run_ok):
    results = run_ok(_window, world, deadline_s=90)
    for result in results:
        assert result["stats"] == results[0]["stats"]  # bitwise the same decision on every rank
        dot, sq_a, sq_b, n_a, n_b = result["stats"]
        assert (n_a, n_b) == result["halves"]
        for measured, exact in zip((dot, sq_a, sq_b), result["reference"]):
            assert measured == pytest.approx(exact, rel=1e-5)
        # the optimizer gets the mean over exactly the window's samples, as plain FSDP2 accumulation gives it
        assert result["grad_error"] < 1e-6


@pytest.mark.timeout(120)
def test_bf16_compute_with_fp32_reduction_measures_the_halves_fsdp_accumulated(run_ok):
    for result in run_ok(_mixed_precision, 2, deadline_s=90):
        assert result["dtypes"] == {"torch.float32"}  # the reduce dtype, where the products are taken
        for measured, exact in zip(result["stats"], result["reference"]):
            assert measured == pytest.approx(exact, rel=1e-5)
        assert result["join_error"] < 1e-6  # the optimizer steps on first half + second half, as plain FSDP2


@pytest.mark.timeout(120)
def test_a_fault_on_one_rank_raises_the_same_error_on_every_rank(run_group):
    outcomes = run_group(_window, 3, 1, deadline_s=90)
    values = [outcome.value for outcome in outcomes]
    assert all(outcome.error is None and outcome.exitcode == 0 for outcome in outcomes), outcomes
    assert all("error" in value for value in values)
    assert len({value["error"] for value in values}) == 1
    assert "failed on rank 1" in values[0]["error"]
    assert "injected fault" in values[1]["cause"]  # the original error, chained where it happened


def _unsharded(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model[0], mesh=init_device_mesh("cpu", (world,)))  # the last layer and the root left plain
    try:
        check_sharding(list(model.parameters()), world)
    except RuntimeError as error:
        return str(error)
    return "accepted"


@pytest.mark.timeout(60)
def test_a_parameter_fully_shard_did_not_reach_is_refused(run_ok):
    message = run_ok(_unsharded, 2, deadline_s=50)[0]
    assert "parameter 2 (shape (3, 7)) is a plain `Parameter`" in message
    assert "Apply `fully_shard` to the root module" in message


def test_a_parameter_offloaded_to_the_cpu_is_refused():
    # what `fully_shard(offload_policy=CPUOffloadPolicy())` leaves on a GPU mesh (it needs CUDA, so it is described
    # here by the attributes the check reads: a DTensor on the CPU whose mesh is on `cuda`)
    from types import SimpleNamespace

    from torch.distributed.tensor import Shard

    mesh = SimpleNamespace(device_type="cuda", size=lambda: 2, shape=(2,), mesh_dim_names=("data_parallel",))
    offloaded = SimpleNamespace(
        requires_grad=True, placements=(Shard(0),), device_mesh=mesh, device=torch.device("cpu"), shape=(4, 3)
    )
    with pytest.raises(RuntimeError, match="does not support CPU offload.*Remove `offload_policy`"):
        check_sharding([offloaded], data_parallel_size=2)
    on_the_device = SimpleNamespace(**{**vars(offloaded), "device": torch.device("cuda", 0)})
    check_sharding([on_the_device], data_parallel_size=2)  # the same parameter on its mesh's device is served

"""SimiGrad under FSDP2 on two-dimensional meshes: tensor parallelism and HSDP, on 4 gloo processes (CPU).

- tensor parallelism: ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)``, ``parallelize_module``
  (``ColwiseParallel`` / ``RowwiseParallel``) on the tensor-parallel mesh, then ``fully_shard`` on the data-parallel
  one. Gradients come out ``(_StridedShard(0), Shard(0))``, ``(Shard(0), Shard(1))`` and, for the row-wise bias,
  ``(Shard(0), Replicate())``: weighed by 1/2.
- HSDP: ``ModelParallelStrategy(data_parallel_size=4)`` and ``fully_shard`` on a ``("replicate", "shard")`` mesh of
  2 x 2: every gradient ``(Replicate(), Shard(0))``, weighed by 1/2.

The measurement alone first (the halves' products against float64 references, and what it refuses), then Lightning
fits audited step by step (:class:`~lightning_simigrad.testing.StepAudit`).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_simigrad import MeasurementError, SimiGrad, Window
from lightning_simigrad.measurement import sharded_halves
from lightning_simigrad.measurement.sharding import check_sharding
from tests.distributed.test_fsdp import same
from tests.measurement.test_sharded_halves import SIZES, _data, _loss
from tests.support.fsdp_modules import Recorder, as_external_process, shard, strategy
from tests.support.helpers import IndexedRegression, RegressionLoss, Regressor, batch_indices, trainer

pytest.importorskip("torch.distributed.tensor.parallel")

WORLD = 4


def _tensor_parallel(module: nn.Sequential, mesh) -> None:
    """Column-wise first layer, row-wise last: the hidden units split over the tensor-parallel ranks."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    last = str(len(module) - 1)
    parallelize_module(module, mesh, {"0": ColwiseParallel(), last: RowwiseParallel()})


def _hsdp_mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))


# ---------------------------------------------------------------------------------------------- the measurement
def _net() -> nn.Sequential:
    """The unit tests' model: eight hidden units, an even split over the ranks of every mesh dimension."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _reference(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The float64 gradient of the mean loss over the samples of ``pieces``, on an unsharded copy."""
    model = _net().double()
    x, y = torch.cat([p[0] for p in pieces]).double(), torch.cat([p[1] for p in pieces]).double()
    (_loss(model, x, y) / len(x)).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _mesh_model(layout: str, rank: int, world: int) -> tuple[nn.Module, int, int]:
    """The test model laid out on a 2-D mesh of all ranks; its data-parallel size and this rank's place in it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _net()
    if layout == "tensor parallel":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        _tensor_parallel(model, mesh["tensor_parallel"])
        data_parallel, dp_rank, mesh = 2, mesh["data_parallel"].get_local_rank(), mesh["data_parallel"]
    else:
        mesh, data_parallel, dp_rank = _hsdp_mesh(world), world, rank
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, data_parallel, dp_rank


def _window_on_mesh(rank: int, world: int, layout: str) -> dict:
    """One window through the measurement; its statistics against float64 references of exactly the halves."""
    model, data_parallel, dp_rank = _mesh_model(layout, rank, world)
    window = Window(tuple(row[:data_parallel] for row in SIZES))
    data = [row[:data_parallel] for row in _data(data_parallel)]
    params = list(model.parameters())
    check_sharding(params, data_parallel)
    measurement, fed, split = sharded_halves(), [0, 0], window.half_split()
    for j in range(window.num_micro_batches):
        measurement.start_micro_batch(window, j, params)
        x, y = data[j][dp_rank]  # the tensor-parallel ranks of a data-parallel rank feed the same samples
        # FSDP2 averages over the data-parallel ranks: a weight W_dp / N makes every sample weigh 1 / N
        (_loss(model, x, y) * data_parallel / window.total).backward()
        fed[j >= split] += sum(window.sizes[j])
        measurement.after_backward(window, j, (fed[0], fed[1]), params)
    placements = sorted({str(tuple(p.grad.placements)) for p in params})
    stats = measurement.collect(loss_scale=None)
    full = torch.cat([p.grad.full_tensor().reshape(-1) for p in params]).double()
    g_a = _reference([piece for row in data[:split] for piece in row])
    g_b = _reference([piece for row in data[split:] for piece in row])
    g = _reference([piece for row in data for piece in row])
    return dict(
        stats=(stats.dot, stats.sq_a, stats.sq_b, stats.n_a, stats.n_b),
        reference=(float(g_a @ g_b), float(g_a @ g_a), float(g_b @ g_b)),
        halves=(sum(map(sum, window.sizes[:split])), sum(map(sum, window.sizes[split:]))),
        grad_error=float((full - g).norm() / g.norm()),
        placements=placements,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "layout,placements",
    [
        (
            "tensor parallel",
            {
                "(Shard(dim=0), Replicate())",
                "(Shard(dim=0), Shard(dim=1))",
                "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
            },
        ),
        ("hsdp", {"(Replicate(), Shard(dim=0))"}),
    ],
)
def test_replicated_pieces_count_once_in_the_halves_products(layout, placements, run_ok):
    results = run_ok(_window_on_mesh, WORLD, layout, deadline_s=100)
    for result in results:
        assert set(result["placements"]) == placements  # the layouts the weights are for
        assert result["stats"] == results[0]["stats"]  # bitwise the same statistics on every rank
        dot, sq_a, sq_b, n_a, n_b = result["stats"]
        assert (n_a, n_b) == result["halves"]
        # absolute values, not only the cosine: a replica counted twice would double them
        for measured, exact in zip((dot, sq_a, sq_b), result["reference"]):
            assert measured == pytest.approx(exact, rel=1e-5)
        assert result["grad_error"] < 1e-6  # the optimizer gets the mean over exactly the window's samples


def _refusals(rank: int, world: int) -> dict:
    """What the measurement refuses on a 1-D mesh of ``world`` ranks, without FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    found = {}
    mesh = init_device_mesh("cpu", (world,))
    # a replicated parameter used on sharded activations: its gradient is Partial, an addend on each rank
    w = nn.Parameter(distribute_tensor(torch.ones(3), mesh, [Replicate()]))
    check_sharding([w], world)  # the parameter itself is served: replicated over every rank
    window, measurement = Window(((1,) * world, (1,) * world)), sharded_halves()
    for j in range(2):
        measurement.start_micro_batch(window, j, [w])
        x = DTensor.from_local(torch.full((1, 3), float(rank + j)), mesh, [Shard(0)])
        (x * w).sum().backward()
        measurement.after_backward(window, j, (world, world * j), [w])
    found["gradient placements"] = str(tuple(w.grad.placements))
    try:
        measurement.collect(loss_scale=None)
        found["partial gradient"] = ("accepted", "")
    except MeasurementError as error:
        found["partial gradient"] = (str(error), repr(error.__cause__))
    partial = nn.Parameter(DTensor.from_local(torch.ones(3), mesh, [Partial()]))
    short = nn.Linear(3, 2)
    fully_shard(short, mesh=init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "single"))["single"])
    for case, params in (("partial parameter", [partial]), ("mesh short of the world", list(short.parameters()))):
        try:
            check_sharding(params, world)
            found[case] = "accepted"
        except RuntimeError as error:
            found[case] = str(error)
    return found


@pytest.mark.timeout(60)
def test_what_cannot_be_summed_exactly_is_refused(run_ok):
    for rank, found in enumerate(run_ok(_refusals, 2, deadline_s=50)):
        assert found["gradient placements"] == "(Partial(sum),)"
        error, cause = found["partial gradient"]
        assert "SimiGrad's FSDP measurement failed on ranks 0, 1" in error  # every rank, at the same step
        if rank == 0:  # the original error is chained on the first failing rank
            assert "along mesh dimension 0 it is `Partial(sum)`" in cause and "squares of addends" in cause
            assert "Apply `fully_shard` to the module that holds its parameter" in cause
        assert "along mesh dimension 0 it is `Partial(sum)`" in found["partial parameter"]
        assert "Give the parameter `Shard` or `Replicate` placements" in found["partial parameter"]
        assert "spans 1 of the 2 ranks: its gradient is not reduced over the others" in found["mesh short of the world"]
        assert "Apply `fully_shard` over the data-parallel mesh" in found["mesh short of the world"]


# ---------------------------------------------------------------------------------------------- Lightning fits
N = 80  # samples per epoch


class TensorParallelRegressor(Regressor):
    """:class:`helpers.Regressor` with its hidden units split over the tensor-parallel ranks, then ``fully_shard``."""

    def configure_model(self) -> None:
        if not hasattr(self, "parallelized"):
            self.parallelized = True
            _tensor_parallel(self.net, self.device_mesh["tensor_parallel"])
            shard(self, [self.net[0], self.net[-1]])


class HSDPRegressor(Regressor):
    """:class:`helpers.Regressor` sharded in pairs of ranks and replicated across the pairs (HSDP)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if not hasattr(self, "parallelized"):
            self.parallelized = True
            mesh = _hsdp_mesh(self.trainer.world_size)
            for part in (self.net[0], self.net[-1], self):
                fully_shard(part, mesh=mesh)


def _mesh_fit(rank: int, world: int, layout: str) -> dict:
    as_external_process(rank, world)
    dataset = IndexedRegression(N)
    audit = Recorder(indices=batch_indices, mean_loss=RegressionLoss(dataset))
    cb = SimiGrad(target_similarity=0.9, max_micro_batch_size=4)
    if layout == "tensor parallel":
        module, parallel = TensorParallelRegressor(), strategy(world, tensor_parallel_size=2)
    else:
        module, parallel = HSDPRegressor(), strategy(world)
    t = trainer(devices=world, strategy=parallel, max_epochs=2, callbacks=[cb, audit])
    t.fit(module, DataLoader(dataset, batch_size=4, shuffle=True))  # B0: 4 per data-parallel rank
    return dict(
        history=cb.history,
        steps=[dataclasses.asdict(step) for step in audit.steps],
        products=audit.recorded.products,
        data_parallel=cb.run.world_size,
        placements=sorted({str(tuple(p.grad.placements)) for p in module.parameters() if p.grad is not None}),
        fed=[i for batch in module.micro_batches for i in batch],
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "layout,data_parallel,replicated",
    [("tensor parallel", 2, "(Shard(dim=0), Replicate())"), ("hsdp", 4, "(Replicate(), Shard(dim=0))")],
)
def test_steps_on_a_2d_mesh_are_exact_and_measure_the_halves(layout, data_parallel, replicated, run_ok):
    ranks = run_ok(_mesh_fit, WORLD, layout, deadline_s=270)
    history, steps, products = ranks[0]["history"], ranks[0]["steps"], ranks[0]["products"]
    assert all(same(r["history"], history) for r in ranks)  # every rank took the same decisions
    assert all(r["data_parallel"] == data_parallel for r in ranks)  # samples counted over data-parallel ranks only
    assert all(replicated in r["placements"] for r in ranks)  # a replicated gradient was there to weigh
    assert len(steps) == len(history) == len(products)
    assert len({h["batch_size"] for h in history}) > 1  # the batch moved
    for step, row, measured in zip(steps, history, products):
        every = step["samples"]  # every data-parallel rank's samples of the step
        assert len(every) == len(set(every)) == row["batch_size"]
        assert step["replicas_fed_alike"]  # the tensor-parallel ranks of a data-parallel rank fed the same samples
        assert step["ranks_identical"]  # all 4 processes hold the same full gradient
        assert step["grad_rel_error"] < 1e-9, step["grad_rel_error"]  # float64 throughout
        if math.isfinite(row["similarity"]):
            assert row["similarity"] == pytest.approx(step["similarity"], abs=1e-5)
            # absolute products, which a replica counted twice would double (the cosine would not show it)
            assert measured == pytest.approx(step["halves_products"], rel=1e-6)
    assert sum(math.isfinite(h["similarity"]) for h in history) >= len(history) - 2  # only tiny tails unmeasured
    # each sample once per epoch across the data-parallel ranks
    seen = [i for s in steps for i in s["samples"]]
    assert sorted(seen) == sorted(list(range(N)) * 2)
    # the processes of one data-parallel rank fed the same batches: every sample on (world / data_parallel) of them
    fed = [i for r in ranks for i in r["fed"]]
    assert sorted(fed) == sorted(list(range(N)) * 2 * (WORLD // data_parallel))

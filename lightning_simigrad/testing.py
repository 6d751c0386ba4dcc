r"""References to check SimiGrad against: every step's gradient is the mean of exactly its samples.

One harness for the project's tests, ``benchmarks/gpu_check.py`` and users who want to see it on their own
model, on one process, on any number of DDP ranks, under FSDP2 (``fully_shard`` with Lightning's
``ModelParallelStrategy``) or under FSDP1 (``FSDPStrategy``):

- :class:`StepAudit`, a Lightning callback placed after :class:`~lightning_simigrad.SimiGrad`: at every optimizer
  step it gathers the samples every rank fed, recomputes the mean loss's gradient over exactly those samples on a
  copy of the module, and records the relative error of the gradient the optimizer is about to apply, whether
  every rank holds the same gradient, and the cosine similarity of the two halves' reference gradients (the
  window's halves in time on one process and under FSDP, the two rank groups under DDP);
- for a hand-built DDP model without Lightning: :func:`run_window` accumulates one window with SimiGrad's loss
  weights, :func:`reference_halves` recomputes :math:`g_A \cdot g_B`, :math:`|g_A|^2`, :math:`|g_B|^2` in
  float64 from every rank's local gradient, :func:`relative_error` compares a measurement with them;
- :class:`HostSyncs` counts host synchronisations (CUDA's sync-debug warnings on a GPU, tensor reads on CPU).
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "AuditedStep",
    "CPUDeepSpeedStrategy",
    "CPUFSDPStrategy",
    "HostSyncs",
    "StepAudit",
    "flat_grad",
    "reference_halves",
    "relative_error",
    "run_window",
]


@dataclass
class AuditedStep:
    """One optimizer step as :class:`StepAudit` saw it."""

    per_rank: list[list[int]]  # the samples each data-parallel rank fed (zero-weight padding samples left out)
    halves: tuple[list[int], list[int]]  # the samples of half A and half B, every rank's
    grad_rel_error: float  # |g - g_ref| / |g_ref| for the gradient the optimizer applies
    ranks_identical: bool  # every rank holds bitwise the same gradient
    similarity: float  # cos(g_A, g_B) of the halves' reference gradients (NaN without two halves)
    # the processes of each data-parallel rank (its tensor-parallel ranks) fed the same samples
    replicas_fed_alike: bool = True
    # g_A.g_B, |g_A|^2, |g_B|^2 of the halves' reference gradients (None without two halves)
    halves_products: tuple[float, float, float] | None = None
    # this process's micro-batches of the step (those that ran a backward), by their samples
    micro_batches: list[int] = field(default_factory=list)
    samples: list[int] = field(init=False)  # every sample of the step, in rank order

    def __post_init__(self) -> None:
        self.samples = [i for rank in self.per_rank for i in rank]


class StepAudit(pl.Callback):
    """After SimiGrad: each optimizer step's gradient against the mean loss over exactly the samples it fed.

    Args:
        indices: the dataset indices of a micro-batch.
        mean_loss: the mean loss of ``module`` (a deep copy of the LightningModule) over the samples ``indices``.

    Every rank must run it (it gathers the samples and gradients of all ranks at every step). Under FSDP the
    gradient compared is the full one (FSDP2: ``DTensor.full_tensor``; FSDP1: ``summon_full_params`` with the
    gradients, which needs ``use_orig_params=True``, Lightning's default), the reference module an unsharded
    copy of the LightningModule taken in ``setup`` (before ``configure_model`` and the strategy shard it, so
    its parameters must exist by then) into which each step loads the full parameters, and the world the
    data-parallel group: the samples are counted per data-parallel rank (under tensor parallelism its processes
    feed the same batches, which ``replicas_fed_alike`` records), the gradients compared on every process.
    """

    def __init__(
        self,
        indices: Callable[[Any], list[int]],
        mean_loss: Callable[[pl.LightningModule, list[int]], torch.Tensor],
    ) -> None:
        self.indices, self.mean_loss = indices, mean_loss
        self.steps: list[AuditedStep] = []
        self._pending: list[int] = []  # the micro-batch started, until its backward has run
        self._last = True  # the micro-batch started is its window's last (DeepSpeed calls the step hook every one)
        self._micro: list[int] = []  # this process's micro-batches of the window so far, by their samples
        self._fed: tuple[list[int], list[int]] = ([], [])  # this rank's samples of the window, by half in time
        self._unsharded: pl.LightningModule | None = None  # under FSDP2: the module as it was before it was sharded

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and isinstance(trainer.strategy, (ModelParallelStrategy, FSDPStrategy)):  # not sharded yet
            keep: dict[int, Any] = {id(trainer): trainer}  # shared, not copied
            if isinstance(trainer.strategy, ModelParallelStrategy):
                keep[id(pl_module.device_mesh)] = pl_module.device_mesh
            self._unsharded = copy.deepcopy(pl_module, memo=keep)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        simigrad = _simigrad(trainer)
        run = simigrad.run if simigrad is not None else None  # (also audits a plain Lightning fit)
        padding = run is not None and run.local_samples == 0  # a zero-weight sample is no sample of the step
        self._pending = [] if padding else list(self.indices(batch))
        self._second = run is not None and run.window is not None and run.micro >= run.window.half_split()
        self._last = run is None or run.window is None or run.micro == run.window.num_micro_batches - 1

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fed[self._second].extend(self._pending)  # a skipped micro-batch has no backward: not a sample
        self._micro.append(len(self._pending))
        self._pending = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fed, self._micro = ([], []), []  # a window abandoned at the epoch's end is dropped, as Lightning drops it

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.strategy.handles_gradient_accumulation and not self._last:
            return  # DeepSpeed: Lightning runs this hook after every micro-batch
        world = _data_parallel_size(trainer)
        simigrad = _simigrad(trainer)
        # the halves in time (one process, FSDP2) or the rank groups (DDP); a plain fit: rank groups when distributed
        measurement = simigrad.run.measurement if simigrad is not None and simigrad.run is not None else None
        in_time = getattr(measurement, "min_micro_batches", 2 if world == 1 else 1) == 2
        mine = [*self._fed[0], *self._fed[1]]
        with _fsdp1_full_parameters(trainer):
            per_rank, grads = [mine], torch.cat([_full(g).reshape(-1) for g in _gradients(trainer, pl_module)])
            source = self._reference_module(pl_module)
        gathered, halves, alike = [grads], (list(self._fed[0]), list(self._fed[1])), True
        processes = trainer.world_size  # tensor-parallel ranks included: every one holds the full gradient too
        if processes > 1:
            every: list[Any] = [None] * processes
            dist.all_gather_object(every, (_data_parallel_rank(trainer), self._fed))
            fed, alike = _by_data_parallel_rank(every, world)
            per_rank = [[*a, *b] for a, b in fed]
            gathered = [torch.empty_like(grads) for _ in range(processes)]
            dist.all_gather(gathered, grads)
            if in_time:
                halves = ([i for a, _ in fed for i in a], [i for _, b in fed for i in b])
            else:  # group A: the first floor(W / 2) ranks
                group_a = [i for r in per_rank[: world // 2] for i in r]
                halves = (group_a, [i for r in per_rank[world // 2 :] for i in r])
        self._fed, micro, self._micro = ([], []), self._micro, []
        reference = self._gradient(source, [i for r in per_rank for i in r])
        similarity, products = math.nan, None
        if halves[0] and halves[1]:
            g_a, g_b = self._gradient(source, halves[0]), self._gradient(source, halves[1])
            similarity = float(g_a @ g_b / (g_a.norm() * g_b.norm()))
            products = (float(g_a @ g_b), float(g_a @ g_a), float(g_b @ g_b))
        self.steps.append(
            AuditedStep(
                per_rank=per_rank,
                halves=halves,
                grad_rel_error=float((grads - reference).norm() / reference.norm()),
                ranks_identical=all(torch.equal(g, gathered[0]) for g in gathered),
                similarity=similarity,
                micro_batches=micro,
                replicas_fed_alike=alike,
                halves_products=products,
            )
        )

    def _reference_module(self, pl_module: pl.LightningModule) -> pl.LightningModule:
        """The module to compute reference gradients on: the LightningModule, or its unsharded copy under FSDP
        with the full parameters loaded (FSDP2: a collective, every rank runs it in the same order; FSDP1: inside
        ``summon_full_params``)."""
        if self._unsharded is None:
            return pl_module
        if isinstance(pl_module.trainer.strategy, FSDPStrategy):  # the full tensors, under FSDP1's wrapper names
            named = [*pl_module.named_parameters(), *pl_module.named_buffers()]
            state = {name.replace("_fsdp_wrapped_module.", ""): value.detach() for name, value in named}
            self._unsharded.load_state_dict(state)
        else:
            state = {name: _full(value).detach() for name, value in pl_module.state_dict().items()}
            self._unsharded.load_state_dict(state)
        return self._unsharded

    def _gradient(self, module: pl.LightningModule, indices: list[int]) -> torch.Tensor:
        model = copy.deepcopy(module)
        model.zero_grad()
        self.mean_loss(model, indices).backward()
        return flat_grad(model)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDP1 strategy on CPU processes (gloo), to check FSDP1 where there is no GPU.

    Lightning refuses ``FSDPStrategy`` with a CPU accelerator (by its exact type) and gives torch's FSDP1 a device
    id only on a GPU, which FSDP1 needs; this subclass passes the CPU device. On GPUs use ``FSDPStrategy`` itself.
    """

    def _setup_model(self, model: nn.Module) -> nn.Module:  # lightning_simigrad._compat lists it
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy on CPU processes (gloo), to check DeepSpeed's ZeRO where there is no GPU.

    Lightning refuses ``DeepSpeedStrategy`` with a CPU accelerator and hands the engine the device's index, which a
    CPU device lacks; this subclass skips the check and passes the local rank. DeepSpeed picks its CPU accelerator
    itself where no GPU is found (``DS_ACCELERATOR=cpu`` says so outright). On GPUs use ``DeepSpeedStrategy``.
    """

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's own refuses a CPU accelerator

    def setup_distributed(self) -> None:  # as DeepSpeedStrategy's, without its check of GPU indices
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()  # lightning_simigrad._compat lists it

    def _setup_model_and_optimizer(self, model: nn.Module, optimizer: Any, lr_scheduler: Any = None) -> Any:
        import argparse

        import deepspeed

        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer


def _fsdp1_full_parameters(trainer: pl.Trainer) -> contextlib.AbstractContextManager[Any]:
    """Under FSDP1: the full parameters and gradients for the block (a collective); elsewhere nothing."""
    if not isinstance(trainer.strategy, FSDPStrategy):
        return contextlib.nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = trainer.strategy.model
    assert model is not None  # wrapped by the strategy before the first step
    return FullyShardedDataParallel.summon_full_params(model, writeback=False, with_grads=True)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective), or the tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _with_grad(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters() if p.grad is not None]


def _gradients(trainer: pl.Trainer, module: nn.Module) -> list[torch.Tensor]:
    """The gradient the optimizer is about to step with, per parameter. Under DeepSpeed's ZeRO it is not in
    ``p.grad`` but in the optimizer's partitions: ``safe_get_full_grad`` assembles it (a collective, in float32)."""
    if not isinstance(trainer.strategy, DeepSpeedStrategy):
        return _with_grad(module)
    from deepspeed.utils import safe_get_full_grad

    full = [safe_get_full_grad(p) for p in module.parameters()]
    return [g.to(p.dtype) for g, p in zip(full, module.parameters()) if g is not None]


def _data_parallel_size(trainer: pl.Trainer) -> int:
    """The data-parallel ranks (under a device mesh, fewer than ``trainer.world_size``)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", trainer.world_size))


def _data_parallel_rank(trainer: pl.Trainer) -> int:
    """This process's data-parallel rank (shared by its tensor-parallel peers under a device mesh)."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("rank", trainer.global_rank))


def _by_data_parallel_rank(every: list[Any], world: int) -> tuple[list[Any], bool]:
    """What each of ``world`` data-parallel ranks fed, from every process's ``(data-parallel rank, fed)``, and
    whether the processes of each data-parallel rank fed alike."""
    fed: dict[int, Any] = {}
    alike = True
    for rank, mine in every:
        alike = alike and fed.setdefault(rank, mine) == mine
    return [fed[rank] for rank in range(world)], alike


def _simigrad(trainer: pl.Trainer) -> Any:
    from lightning_simigrad.callback import SimiGrad

    return next((c for c in trainer.callbacks if isinstance(c, SimiGrad)), None)  # type: ignore[attr-defined]


def flat_grad(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flattened into one tensor."""
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def run_window(model: nn.Module, micro: list[tuple[torch.Tensor, torch.Tensor]], counts: list[int], world: int) -> None:
    """Accumulate one window, each loss weighted by W n_micro / N; under DDP ``no_sync`` but the last."""
    total = sum(counts)
    for i, (x, y) in enumerate(micro):
        accumulate = isinstance(model, DistributedDataParallel) and i < len(micro) - 1
        with model.no_sync() if accumulate else contextlib.nullcontext():  # type: ignore[operator]
            loss = nn.functional.mse_loss(model(x), y) * (world * x.shape[0] / total)
            loss.backward()


def reference_halves(local_grad: torch.Tensor, counts: list[int], group: Any = None) -> tuple[float, float, float]:
    """(g_A.g_B, |g_A|^2, |g_B|^2) from every rank's local weighted gradient, gathered and combined in float64."""
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(local_grad, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, local_grad.to(torch.float64), group=group)
    size_a, total = world // 2, sum(counts)
    n_a, n_b = sum(counts[:size_a]), sum(counts[size_a:])
    g_a = total / (world * n_a) * torch.stack(gathered[:size_a]).sum(0)
    g_b = total / (world * n_b) * torch.stack(gathered[size_a:]).sum(0)
    return float(g_a @ g_b), float(g_a @ g_a), float(g_b @ g_b)


def relative_error(stats: Any, reference: tuple[float, float, float]) -> float:
    """The largest relative error of ``stats`` against ``reference`` (the dot relative to |g_A| |g_B|)."""
    dot, sq_a, sq_b = reference
    scale = (sq_a * sq_b) ** 0.5
    return max(abs(stats.dot - dot) / scale, abs(stats.sq_a - sq_a) / sq_a, abs(stats.sq_b - sq_b) / sq_b)


class HostSyncs:
    """Counts host synchronisations: CUDA's sync-debug warnings on a GPU, tensor reads to Python on CPU."""

    NAMES = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.count = 0

    def __enter__(self) -> HostSyncs:
        if self.device.type == "cuda":
            self._caught = warnings.catch_warnings(record=True)
            self._records = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}
            for name, method in self._saved.items():
                setattr(torch.Tensor, name, self._counting(method))
        return self

    def _counting(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return method(tensor, *args, **kwargs)

        return counted

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            self.count = sum("synchroniz" in str(r.message) for r in self._records)
            self._caught.__exit__(*exc)
        else:
            for name, method in self._saved.items():
                setattr(torch.Tensor, name, method)

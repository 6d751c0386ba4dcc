"""Every private member of Lightning and torch that SimiGrad uses, in one table, checked when a fit starts.

SimiGrad makes Lightning's accumulation windows variable, counts its step-based settings in samples and
measures inside DDP's communication hook. Lightning and torch offer no public way to do some of that, so
a few private members are read or replaced. They are listed in :data:`PRIVATE_MEMBERS` with what each is
for and the versions it was checked against; :func:`check` looks every one of them up on the live
objects when a fit starts, before anything is changed, and names the Lightning to install when one is
missing. Modules outside :mod:`lightning_simigrad.integration` reach torch's private members only through
the functions below (``tests/integration/test_compat.py`` scans the sources for it).

Nothing here changes anything at import. Replacements are made on the objects of one fit (loop
instances, one Trainer, one launcher) and undone after it; see :mod:`lightning_simigrad.integration`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning
import torch

__all__ = [
    "CHECKED_LIGHTNING",
    "CHECKED_TORCH",
    "PRIVATE_MEMBERS",
    "Private",
    "DEEPSPEED_MEMBERS",
    "check",
    "check_deepspeed",
    "foreach_add_",
    "foreach_copy",
    "foreach_mul_",
    "foreach_sub",
    "foreach_norm",
    "zero_clear_gradients",
    "zero_partitions",
]

CHECKED_LIGHTNING = "2.6"  # the minor version every member below was read in (pyproject pins it)
CHECKED_TORCH = "2.14"
INSTALL = "lightning>=2.6,<2.7"


@dataclass(frozen=True)
class Private:
    """A private member: its owner (where it is looked up), its name, and what SimiGrad uses it for."""

    owner: str
    name: str
    used_for: str
    library: str = "lightning"


PRIVATE_MEMBERS: tuple[Private, ...] = (
    # accumulation windows of any length (integration/accumulation.py)
    Private("_TrainingEpochLoop", "_accumulated_batches_reached", "ends a window where the plan ends it"),
    Private("_AutomaticOptimization", "_make_zero_grad_fn", "zeroes the gradient at a window's start only"),
    Private("_AutomaticOptimization", "_on_before_zero_grad", "zero_grad as Lightning does it"),
    Private("_AutomaticOptimization", "_optimizer_zero_grad", "zero_grad as Lightning does it"),
    Private("_AutomaticOptimization", "_skip_backward", "no zero_grad, no step where Lightning skips the backward"),
    Private("_TrainingEpochLoop", "_should_accumulate", "an epoch without backward accumulates throughout (SWA)"),
    # step-based settings counted in samples (integration/sample_schedules.py)
    Private("_TrainingEpochLoop", "_update_learning_rates", "steps step-interval schedulers per B0 samples"),
    Private("_TrainingEpochLoop", "_should_check_val_fx", "validation after the samples of its interval"),
    Private("_TrainingEpochLoop", "_should_check_val_epoch", "Lightning's own epoch rule, kept"),
    Private("_FitLoop", "_data_fetcher", "a resumed epoch's data iterator"),
    Private("_FitLoop", "_can_stop_early", "a stop min_epochs/min_steps hold back keeps the validation cadence"),
    Private("_FitLoop", "_data_source", "hands Lightning the DataLoader with the adaptive sampler"),
    Private("_FitLoop", "_combined_loader", "reloads the DataLoader after a tuner's trials"),
    Private("Trainer", "_val_check_time_interval", "time-based validation keeps Lightning's rule"),
    Private("call", "_call_lightning_module_hook", "steps a scheduler through the module's hook"),
    Private("data_connector", "_DataLoaderSource", "the training data source SimiGrad wraps"),
    # the user's other callbacks (integration/neighbours.py, integration/progress_bar.py)
    Private("LearningRateMonitor", "_extract_lr", "reports the learning rate the step applies"),
    Private("BatchSizeFinder", "_batch_arg_name", "the batch size a finder is about to tune"),
    Private("TQDMProgressBar", "_train_progress_bar", "the epoch's micro-batch total"),
    # the reference harness (testing.py): FSDP1 on CPU, which Lightning gives no device id
    Private("FSDPStrategy", "_setup_model", "testing.CPUFSDPStrategy wraps the model with the CPU device"),
    Private("DeepSpeedStrategy", "_init_deepspeed_distributed", "testing.CPUDeepSpeedStrategy joins the group"),
    Private("DeepSpeedStrategy", "_setup_model_and_optimizer", "testing.CPUDeepSpeedStrategy names the CPU rank"),
    # torch (measurement/, data/)
    Private("DistributedDataParallel", "_comm_hooks", "finds a communication hook already registered", "torch"),
    Private("DistributedDataParallel", "_get_ddp_logging_data", "finds a built-in communication hook", "torch"),
    Private("GradScaler", "_get_scale_async", "reads the loss scale without a host synchronisation", "torch"),
    Private("RandomSampler", "_num_samples", "a RandomSampler of its own length has no regenerable order", "torch"),
    Private("torch", "_foreach_mul_", "rescales a step that fed fewer samples than planned", "torch"),
    Private("torch", "_foreach_norm", "the halves' norms in one fused op, whatever the number of tensors", "torch"),
    Private("torch", "_foreach_add_", "re-joins the halves in one fused op, whatever the number of tensors", "torch"),
    Private("torch", "_foreach_mul", "FSDP1: copies the first half's shards in one op", "torch"),
    Private("torch", "_foreach_sub", "FSDP1: the second half's shards (the window's less the first's)", "torch"),
)


def _owners() -> dict[str, Any]:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateMonitor, TQDMProgressBar
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
    from lightning.pytorch.trainer import call
    from lightning.pytorch.trainer.connectors import data_connector
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import RandomSampler

    return {
        "_TrainingEpochLoop": _TrainingEpochLoop,
        "_AutomaticOptimization": _AutomaticOptimization,
        "_FitLoop": _FitLoop,
        "Trainer": Trainer,
        "call": call,
        "data_connector": data_connector,
        "LearningRateMonitor": LearningRateMonitor,
        "BatchSizeFinder": BatchSizeFinder,
        "TQDMProgressBar": TQDMProgressBar,
        "FSDPStrategy": FSDPStrategy,
        "DeepSpeedStrategy": DeepSpeedStrategy,
        "DistributedDataParallel": DistributedDataParallel,
        "GradScaler": torch.amp.GradScaler,
        "RandomSampler": RandomSampler,
        "torch": torch,
    }


# members that exist only on instances (set in __init__), looked up on one made for the purpose
_INSTANCE_MEMBERS = {"_skip_backward", "_data_fetcher", "_data_source", "_combined_loader", "_val_check_time_interval"}
_INSTANCE_MEMBERS |= {"_train_progress_bar", "_batch_arg_name", "_comm_hooks", "_num_samples"}


def missing(objects: Sequence[Any] = ()) -> list[Private]:
    """The members of :data:`PRIVATE_MEMBERS` this installation lacks.

    Class members are looked up on their class; members set in ``__init__`` on the live ``objects`` given (a
    Trainer, its loops, ...) that are instances of their owner, and are skipped when none is given.
    """
    owners = _owners()
    absent = []
    for member in PRIVATE_MEMBERS:
        owner = owners.get(member.owner)
        if owner is None:
            absent.append(member)
            continue
        if member.name not in _INSTANCE_MEMBERS:
            if not hasattr(owner, member.name):
                absent.append(member)
            continue
        live = [o for o in objects if isinstance(owner, type) and isinstance(o, owner)]
        if live and not all(member.name in vars(o) for o in live):
            absent.append(member)
    return absent


def check(trainer: Any) -> None:
    """Raise a clear error, before SimiGrad changes anything, if this Lightning or torch lacks a member it uses."""
    loop = trainer.fit_loop
    absent = missing([trainer, loop, loop.epoch_loop, loop.epoch_loop.automatic_optimization])
    if absent:
        names = ", ".join(f"`{m.owner}.{m.name}` ({m.used_for})" for m in absent)
        raise RuntimeError(
            f"SimiGrad uses private members of Lightning {CHECKED_LIGHTNING} and torch {CHECKED_TORCH} that this"
            f" installation (lightning {lightning.__version__}, torch {torch.__version__}) lacks: {names}."
            f" Install `{INSTALL}` and a torch of the version it supports."
        )


# ------------------------------------------------------------------------------ torch's, for the library's layers
def foreach_mul_(tensors: list[torch.Tensor], factor: float) -> None:
    """Multiply every tensor in place, in one fused kernel per device and dtype."""
    torch._foreach_mul_(tensors, factor)


def foreach_add_(tensors: list[torch.Tensor], others: list[torch.Tensor]) -> None:
    """``tensors[i] += others[i]`` for every i, in one fused kernel per device and dtype."""
    torch._foreach_add_(tensors, others)


def foreach_copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """New tensors equal to ``tensors`` (a multiplication by one: exact), in one fused kernel per device and dtype."""
    return list(torch._foreach_mul(tensors, 1.0))


def foreach_sub(tensors: list[torch.Tensor], others: list[torch.Tensor]) -> list[torch.Tensor]:
    """New tensors ``tensors[i] - others[i]``, in one fused kernel per device and dtype."""
    return list(torch._foreach_sub(tensors, others))


def foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The 2-norm of every tensor, accumulated and returned in ``dtype``, in one fused kernel per device and dtype."""
    return list(torch._foreach_norm(tensors, 2, dtype=dtype))


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> None:
    """Every rank's ``tensor``, concatenated into ``output`` in rank order (torch 2.14 renamed
    ``all_gather_into_tensor``, deprecated there, to ``all_gather_single``)."""
    gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
    gather(output, tensor, group=group)


def scaler_scale(scaler: Any) -> torch.Tensor | None:
    """A GradScaler's scale tensor as it is on the device (None before its first step), read without a sync."""
    return scaler._get_scale_async() if hasattr(scaler, "_get_scale_async") else None


def random_sampler_length(sampler: Any) -> int | None:
    """The length a ``RandomSampler`` was given (None: its data source's)."""
    return sampler._num_samples


def comm_hook_name(ddp_model: Any) -> str | None:
    """The name of a communication hook already registered on a DDP model, or None.

    ``register_comm_hook`` appends to ``_comm_hooks``; the built-in (C++) hooks leave that list empty but
    record their name in DDP's logging data. Both are private, so each is read defensively.
    """
    hooks = getattr(ddp_model, "_comm_hooks", None)
    if hooks:
        hook = hooks[0][0]
        return str(getattr(hook, "__qualname__", hook))
    try:
        name = ddp_model._get_ddp_logging_data().get("comm_hook")
    except Exception:  # private API: its absence must not block registration
        name = None
    return str(name) if name else None


def forget_last_comm_hook(ddp_model: Any) -> None:
    """Undo the record of a hook DDP appended before its reducer refused it."""
    ddp_model._comm_hooks.pop()


# DeepSpeed ZeRO stages 1 and 2 (measurement/zero_partitions.py): members of its ZeRO optimizer, read in these minor
# versions; another DeepSpeed is refused when the measurement attaches
CHECKED_DEEPSPEED = ("0.19",)
INSTALL_DEEPSPEED = "deepspeed>=0.19,<0.20"
DEEPSPEED_MEMBERS: tuple[Private, ...] = (
    Private(
        "DeepSpeedZeroOptimizer", "averaged_gradients", "this rank's partition of the reduced gradient", "deepspeed"
    ),
    Private("DeepSpeedZeroOptimizer", "all_grad_tensors", "cleared after the midpoint, as a skipped step", "deepspeed"),
    Private("DeepSpeedZeroOptimizer", "micro_step_id", "reset after the midpoint, as a step does", "deepspeed"),
    Private(
        "DeepSpeedZeroOptimizer",
        "_release_preflattened_grad_buffers",
        "releases the midpoint's partition buffers, as a skipped step does",
        "deepspeed",
    ),
)


def check_deepspeed(engine: Any) -> None:
    """Raise a clear error if this DeepSpeed is not one whose ZeRO optimizer SimiGrad was checked against."""
    import deepspeed

    version = deepspeed.__version__
    zero = getattr(engine, "optimizer", None)
    absent = [m for m in DEEPSPEED_MEMBERS if zero is None or not hasattr(zero, m.name)]
    if not version.startswith(tuple(f"{v}." for v in CHECKED_DEEPSPEED)) or absent:
        names = ", ".join(f"`{m.owner}.{m.name}` ({m.used_for})" for m in absent) or "none missing"
        raise RuntimeError(
            f"SimiGrad measures DeepSpeed's ZeRO stages 1 and 2 through members of its ZeRO optimizer read in"
            f" DeepSpeed {', '.join(CHECKED_DEEPSPEED)}; this is deepspeed {version} ({names}). Install"
            f" `{INSTALL_DEEPSPEED}`."
        )


def zero_partitions(zero: Any) -> list[Sequence[torch.Tensor]]:
    """This rank's partition of the reduced gradient, per param group, as DeepSpeed's ZeRO optimizer lays it out
    for the step (set after a backward at an accumulation boundary)."""
    partitions: list[Sequence[torch.Tensor]] = []
    for group in sorted(zero.averaged_gradients):
        tensors = zero.averaged_gradients[group]
        if not isinstance(tensors, list):
            raise RuntimeError(
                f"DeepSpeed's ZeRO optimizer holds param group {group}'s gradient partition as"
                f" {type(tensors).__name__}, not the list of tensors SimiGrad reads (ZeRO stages 1 and 2 in fp32 or"
                " bf16, gradients accumulated in the parameters' dtype, without offload)"
            )
        partitions.append(tensors)
    return partitions


def zero_clear_gradients(zero: Any) -> None:
    """Clear the ZeRO optimizer's gradient state without a step, as DeepSpeed does for a step it skips."""
    zero.zero_grad(set_to_none=True)
    zero._release_preflattened_grad_buffers()
    for group in list(zero.averaged_gradients):
        zero.averaged_gradients[group] = None
        zero.all_grad_tensors[group] = None
    zero.micro_step_id = -1  # DeepSpeed's INITIAL_MICRO_STEP_ID, as its step sets it

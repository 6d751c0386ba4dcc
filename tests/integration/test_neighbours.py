"""Bad arguments fail at construction; setups SimiGrad cannot serve fail before the first step."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_simigrad import SimiGrad
from tests.support.helpers import IndexedRegression, Regressor, trainer


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(target_similarity=1.0), "target_similarity"),
        (dict(target_similarity=-1.0), "target_similarity"),
        (dict(target_similarity=0.8, min_batch_size=512, max_batch_size=64), "min_batch_size"),
        (dict(target_similarity=0.8, min_batch_size=0), "min_batch_size"),
        (dict(target_similarity=0.8, max_batch_size=-1), "max_batch_size"),
        (dict(target_similarity=0.8, max_micro_batch_size=0), "max_micro_batch_size"),
        (dict(target_similarity=0.8, initial_batch_size=2.5), "initial_batch_size"),
        (dict(target_similarity=0.8, lr_scaling="cubic"), "lr_scaling"),
        (dict(target_similarity=0.8, lr_scaling_blend=2.0), "lr_scaling_blend"),
        (dict(target_similarity=0.8, controller="pid"), "controller"),
        (dict(target_similarity=0.8, warmup_steps=-3), "warmup_steps"),
        (dict(target_similarity=0.8, history_size=-1), "history_size"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`") as info:
        SimiGrad(**kwargs)
    bad = [v for k, v in kwargs.items() if k == name or (name == "min_batch_size" and k == "min_batch_size")][-1]
    assert repr(bad) in str(info.value) or str(bad) in str(info.value)


class Manual(Regressor):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class HandlesAccumulation(SingleDeviceStrategy):
    """Stands for a strategy other than DeepSpeed's that accumulates gradients itself."""

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True


class Unsized(Dataset):
    def __getitem__(self, i):
        return i, torch.zeros(6, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)


class Stream(IterableDataset):
    def __iter__(self):
        yield from IndexedRegression(32)


def fit_expecting_error(match, model=None, loader=None, **trainer_kwargs):
    model = model or Regressor()
    loader = DataLoader(IndexedRegression(64), batch_size=8) if loader is None else loader
    t = trainer(callbacks=[SimiGrad(0.8)] + trainer_kwargs.pop("callbacks", []), **trainer_kwargs)
    with pytest.raises(RuntimeError, match=match):
        t.fit(model, loader)
    assert model.micro_batches == []  # refused before any training step
    assert t.global_step == 0


def test_manual_optimization_is_refused():
    fit_expecting_error("automatic_optimization", model=Manual())


def test_a_strategy_that_accumulates_itself_is_refused():
    fit_expecting_error(
        r"DeepSpeed's ZeRO stages 1 and 2.*`HandlesAccumulation`",
        strategy=HandlesAccumulation(device=torch.device("cpu")),
    )


def test_fsdp1_is_served_sharded_and_refused_replicated_or_offloaded():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_simigrad.integration.refusals import refuse_unsupported

    for served in ("FULL_SHARD", "SHARD_GRAD_OP"):
        refuse_unsupported(
            SimpleNamespace(strategy=FSDPStrategy(sharding_strategy=served), callbacks=[]), Regressor(), None
        )
    for refused, message in [
        (
            dict(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={torch.nn.Linear}),
            "`FSDPStrategy` uses HYBRID_SHARD",
        ),
        (dict(sharding_strategy="NO_SHARD"), "`FSDPStrategy` uses NO_SHARD"),
        (dict(cpu_offload=True), "does not support CPU offload"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            refuse_unsupported(SimpleNamespace(strategy=FSDPStrategy(**refused), callbacks=[]), Regressor(), None)


def test_gradient_accumulation_scheduler_is_refused():
    fit_expecting_error("GradientAccumulationScheduler", callbacks=[GradientAccumulationScheduler({0: 2})])


def test_a_stream_without_a_batch_size_is_refused():
    # a stream is served (tests/integration/test_streams.py), re-batched from its loader's batches: it needs them
    fit_expecting_error(r"`batch_size=None`", loader=DataLoader(Stream(), batch_size=None))


def test_unsized_dataset_is_refused():
    fit_expecting_error("__len__", loader=DataLoader(Unsized(), batch_size=8, sampler=list(range(16))))


def test_a_loader_without_batch_size_is_refused():
    from torch.utils.data import BatchSampler, SequentialSampler

    batches = BatchSampler(SequentialSampler(range(64)), batch_size=8, drop_last=False)
    fit_expecting_error("batch_size", loader=DataLoader(IndexedRegression(64), batch_sampler=batches))


def test_several_loaders_are_refused():
    loaders = {
        "a": DataLoader(IndexedRegression(64), batch_size=8),
        "b": DataLoader(IndexedRegression(64), batch_size=8),
    }
    fit_expecting_error("one `torch.utils.data.DataLoader`", loader=loaders)

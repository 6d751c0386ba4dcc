"""`loss_items` across ranks: every step the mean over the labelled tokens of every rank, the halves token means.

DDP at W = 2 and 3 (the halves are rank groups, whose tokens differ), FSDP2 (`fully_shard`, halves in time) and
FSDP1 (two rank groups inside its reduce-scatter) at W = 2, and over a stream (each rank re-batching its own part)
under DDP and FSDP2 at W = 2, on gloo, with the language-model-style module of
tests/support/token_modules.py; every step is audited against the float64 token mean of all ranks' samples.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_simigrad import SimiGrad
from lightning_simigrad.testing import StepAudit
from tests.support.distributed import run_ok
from tests.support.fsdp_modules import as_external_process, fsdp1, shard, strategy
from tests.support.helpers import trainer
from tests.support.streams import IndexedStream
from tests.support.token_modules import Sequences, TokenMeanLoss, TokenModel, indices_of, labelled_tokens, pad_collate


class ShardedTokenModel(TokenModel):
    def configure_model(self) -> None:
        if not hasattr(self, "fully_sharded"):
            self.fully_sharded = True
            shard(self, [self.embed, self.head[0], self.head[2]])


def _fit(rank: int, world: int, setting: str, stream: bool = False) -> dict:
    as_external_process(rank, world)
    pl.seed_everything(0)
    dataset = Sequences()
    audit = StepAudit(indices=indices_of, mean_loss=TokenMeanLoss(dataset))
    cb = SimiGrad(0.5, loss_items=labelled_tokens, max_micro_batch_size=3, initial_batch_size=4 * world)
    module: TokenModel = TokenModel()
    if setting == "ddp":
        parallel = DDPStrategy(process_group_backend="gloo")
    elif setting == "fsdp2":
        module, parallel = ShardedTokenModel(), strategy(world)
    else:
        parallel = fsdp1(world)
    t = trainer(devices=world, strategy=parallel, max_epochs=2, callbacks=[cb, audit])
    data = IndexedStream(dataset, shuffle=True) if stream else dataset  # a stream: each rank reads every W-th
    t.fit(module, DataLoader(data, batch_size=3, shuffle=not stream, collate_fn=pad_collate))
    return dict(
        sizes=[row["batch_size"] for row in cb.history],
        similarity=[row["similarity"] for row in cb.history],
        reference=[step.similarity for step in audit.steps],
        errors=[step.grad_rel_error for step in audit.steps],
        samples=[len(step.samples) for step in audit.steps],
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("setting", "world", "stream"),
    [("ddp", 2, False), ("ddp", 3, False), ("fsdp2", 2, False), ("fsdp1", 2, False), ("ddp", 2, True),
     ("fsdp2", 2, True)],
    ids=str,
)  # fmt: skip
def test_every_step_is_the_mean_over_every_ranks_tokens(setting: str, world: int, stream: bool) -> None:
    ranks = run_ok(_fit, world, setting, stream, deadline_s=240)
    first = ranks[0]
    assert all(r["sizes"] == first["sizes"] and r["similarity"] == first["similarity"] for r in ranks)
    assert first["sizes"] == first["samples"] and len(set(first["sizes"])) >= 2  # in samples; the batch moved
    # FSDP1 at the tolerance of its own exactness tests (test_fsdp.py: 1e-6; here 1.6e-7), the others to rounding
    exact = 1e-6 if setting == "fsdp1" else 1e-12
    assert max(max(r["errors"]) for r in ranks) < exact
    pairs = list(zip(first["similarity"], first["reference"], strict=True))
    assert max(abs(ours - reference) for ours, reference in pairs) < 10 * exact


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "broadcast", "broadcast_object_list", "reduce_scatter_tensor", "all_to_all_single")  # fmt: skip


class CountCollectives(pl.Callback):
    """Every collective the training steps issue through ``torch.distributed``, by name (DDP's own reduction goes
    through SimiGrad's communication hook, so it is counted too, alike in every fit)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.originals: dict[str, object] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        import torch.distributed as dist

        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self.originals[name] = original

            def counted(*args, __name=name, __original=original, **kwargs):
                self.calls[__name] = self.calls.get(__name, 0) + 1
                return __original(*args, **kwargs)

            setattr(dist, name, counted)

    def on_train_end(self, trainer, pl_module) -> None:
        import torch.distributed as dist

        for name, original in self.originals.items():
            setattr(dist, name, original)


def _count(rank: int, world: int, items: bool) -> tuple[dict[str, int], int]:
    as_external_process(rank, world)
    pl.seed_everything(0)
    counter = CountCollectives()
    cb = SimiGrad(0.5, loss_items=labelled_tokens if items else None, max_micro_batch_size=3,
                  initial_batch_size=12, adjust=False)  # fmt: skip
    ddp = DDPStrategy(process_group_backend="gloo")
    t = trainer(devices=world, strategy=ddp, max_epochs=1, callbacks=[cb, counter])
    t.fit(TokenModel(), DataLoader(Sequences(), batch_size=3, shuffle=True, collate_fn=pad_collate))
    return counter.calls, len(cb.history)


@pytest.mark.timeout(300)
def test_loss_items_add_no_collective_to_a_step() -> None:
    """Under DDP a step weighed by loss items costs what any step costs: the gradient's reduction and one all-gather
    of the rows, which carry the items (before, an all-reduce of the items came beside them)."""
    (plain, steps), _ = run_ok(_count, 2, False, deadline_s=240)
    (weighed, weighed_steps), _ = run_ok(_count, 2, True, deadline_s=240)
    assert steps == weighed_steps > 5
    assert weighed == plain
    gathers = sum(n for name, n in weighed.items() if name.startswith("all_gather"))
    assert gathers == steps  # one exchange a step

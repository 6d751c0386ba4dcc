"""Variable-length accumulation windows on a DeepSpeed engine against plain SGD: where the weights part and why.

    DS_ACCELERATOR=cpu python benchmarks/deepspeed_accumulation.py             # one process, ZeRO 1 and 2
    DS_ACCELERATOR=cpu python benchmarks/deepspeed_accumulation.py --world 2   # two gloo processes

Needs DeepSpeed (``pip install --no-build-isolation deepspeed`` after torch; on CPU it picks its CPU accelerator and
gloo). About 15 s a configuration on 2 CPU cores, most of it DeepSpeed's imports.

Each rank runs windows of 4, 2, 3, 1, 4, 2 micro-batches of 4 samples through ``deepspeed.initialize``'s engine the
way a variable-window integration drives it: the accumulation boundary set before every micro-batch
(``engine.set_gradient_accumulation_boundary``), each micro-batch's mean loss divided by the window's length, and
``engine.backward(loss, scale_wrt_gas=False)``, ``engine.step()`` after every micro-batch (the engine steps the
optimizer only at the boundary). Before each window a reference copy of the model takes the engine's weights and
one SGD step on the mean loss over exactly the window's samples of every rank. It prints, for ZeRO stages 1 and 2,
with DeepSpeed's own default gradient clipping (``gradient_clipping`` 1.0 when the config leaves it out) and with
none (0.0, what Lightning's ``DeepSpeedStrategy`` writes when ``Trainer(gradient_clip_val=None)``), every window's
gradient norm and its update's relative error against the reference's.

What it shows: with clipping off, every window's update matches the reference's to float32 rounding (~3e-7 of the
update) at both stages, whatever its length; with DeepSpeed's default, exactly the windows whose gradient norm
exceeds 1.0 part from it, by 1 - 1/|g| (a short window averages fewer samples, so its gradient is larger). The
engine accumulates variable windows exactly; the 2e-2 seen before was DeepSpeed clipping the short windows'
gradients.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket

import torch
import torch.multiprocessing as mp
from torch import nn

WINDOWS = (4, 2, 3, 1, 4, 2)  # micro-batches a rank, per optimizer step
MICRO = 4  # samples a micro-batch
LR = 0.1


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def run(rank: int, world: int, port: int, stage: int, clipping: float | None, out: dict) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
    )  # fmt: skip
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = _model()
    reference = copy.deepcopy(model)
    x, y = torch.randn(400, 5), 1.5 * torch.randn(400, 1)  # gradients of norm about 1: some windows above it
    config: dict = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # torch's SGD as the client optimizer
    }
    if clipping is not None:
        config["gradient_clipping"] = clipping
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    start, rows = 0, []
    for k in WINDOWS:
        window = slice(start, start + world * k * MICRO)  # rank r feeds the r-th block of k micro-batches
        before = _flat(engine.module.parameters())
        with torch.no_grad():  # each window from the engine's weights: one window's update at a time
            for p, q in zip(reference.parameters(), engine.module.parameters()):
                p.copy_(q)
        reference_opt.zero_grad()
        nn.functional.mse_loss(reference(x[window]), y[window]).backward()
        norm = float(_flat(p.grad for p in reference.parameters()).norm())
        reference_opt.step()
        mine = start + rank * k * MICRO
        for j in range(k):
            micro = slice(mine + j * MICRO, mine + (j + 1) * MICRO)
            engine.set_gradient_accumulation_boundary(j == k - 1)
            loss = nn.functional.mse_loss(engine(x[micro]), y[micro]) / k
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
        start = window.stop
        ours, theirs = _flat(engine.module.parameters()) - before, _flat(reference.parameters()) - before
        rows.append((k, norm, float((ours - theirs).norm() / theirs.norm())))
    if rank == 0:
        out["rows"], out["steps"] = rows, engine.global_steps
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=1, help="gloo processes (default 1)")
    args = parser.parse_args()
    print(f"windows {list(WINDOWS)} micro-batches of {MICRO} samples a rank, {args.world} rank(s), SGD lr {LR}")
    print(f"{'stage':>5} {'clipping':>17} {'window':>6} {'|g|':>7} {'update vs SGD':>14}")
    for stage in (1, 2):
        for clipping, label in ((None, "DeepSpeed default"), (0.0, "0.0 (Lightning)")):
            with mp.Manager() as manager:
                out = manager.dict()
                mp.spawn(run, (args.world, _free_port(), stage, clipping, out), nprocs=args.world)
                rows, steps = out["rows"], out["steps"]
            for k, norm, error in rows:
                print(f"{stage:>5} {label:>17} {k:>6} {norm:>7.3f} {error:>14.1e}")
            worst = max(e for *_, e in rows)
            print(f"{stage:>5} {label:>17} engine steps {steps} of {len(WINDOWS)}; worst error {worst:.1e}")


if __name__ == "__main__":
    main()

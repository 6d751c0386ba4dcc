"""The training script the fault-tolerance tests launch (with torchrun, or as one plain process), and its log.

    torchrun --nproc-per-node=2 --max-restarts=1 tests/support/fault_worker.py --out OUT --kill-at 10

Every run of it -- each attempt of each rank -- appends JSON lines to its own ``OUT/log.rank{R}.pid{P}.jsonl``:
one ``start`` line (the SimiGrad steps the run resumed from), one ``step`` line per optimizer step (the samples
this rank fed, the batch size, the similarity), and ``done`` after ``fit`` returned. Rank 0 then saves the final
weights. It resumes the way the README tells users to: ``trainer.fit(..., ckpt_path="last")`` with a
``ModelCheckpoint(save_last=True)``.

Faults, each injected once per output folder (a marker file remembers it across restarts and new nodes):

- ``--kill-at K``: rank ``--fault-rank`` SIGKILLs itself in the middle of window ``K`` (its second micro-batch);
- ``--hang-at K``: that rank stops there until something kills it (a test kills its whole node);
- ``--crash-writing K``: the process that writes checkpoints (rank 0: Lightning writes them there only) SIGKILLs
  itself halfway through writing the ``K``-th checkpoint file; ``--fault-rank`` does not apply.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tests.support` imports

N = 203  # training samples: an odd count, so epoch tails are uneven
B0 = 8  # 4 per rank on 2 ranks


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=4, help="checkpoint every this many optimizer steps")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--crash-writing", type=int)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument(
        "--elastic",
        type=int,
        metavar="MAX_ACCUMULATION",
        help="follow the batch: SimiGrad(elastic=Elastic(max_accumulation=..., max_nodes=2, on_request='continue')),"
        " one rank a node, the nodes torchrun's rendezvous gave (--devices and --nodes do not apply)",
    )
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds every micro-batch waits (a slower fit)")
    parser.add_argument(
        "--master-port",
        type=int,
        help="the port rank 0 hosts the group's store on, in every attempt (torchrun's own choice is a port it bound"
        " and released: another socket can take it before rank 0 binds it)",
    )
    return parser.parse_args(argv)


def once(out: Path, name: str) -> bool:
    """True the first time a fault named ``name`` fires for this output folder (across processes and restarts)."""
    try:
        (out / f"{name}.fired").open("x").close()
    except FileExistsError:
        return False
    return True


def main(argv: list[str]) -> None:
    args = parse(argv)
    if args.master_port is not None:  # read by Lightning's TorchElasticEnvironment when it creates the group
        os.environ["MASTER_PORT"] = str(args.master_port)
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_simigrad import Elastic, SimiGrad
    from tests.support.helpers import IndexedRegression, Regressor

    class Log(pl.Callback):
        """After SimiGrad in the callback list: writes what every step of this rank trained."""

        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            self.simigrad = next(c for c in trainer.callbacks if isinstance(c, SimiGrad))  # type: ignore[attr-defined]
            self.file = (args.out / f"log.rank{trainer.global_rank}.pid{os.getpid()}.jsonl").open("a")
            self.fed: list[int] = []
            self.micro = 0

        def write(self, **row: Any) -> None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
            os.fsync(self.file.fileno())  # the line survives a SIGKILL a moment later

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.write(
                event="start",
                resumed_steps=self.simigrad.steps,
                restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                world=trainer.world_size,
                node=trainer.node_rank,
                # rank 0's process tells the group's processes apart from every other group's (a membership change
                # starts new ones without counting a restart)
                leader=int(trainer.strategy.broadcast(os.getpid(), src=0)),
            )

        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int
        ) -> None:
            rank, step = trainer.global_rank, self.simigrad.steps
            if self.micro == 1 and rank == args.fault_rank:  # the window's second micro-batch: a step half done
                if step == args.kill_at and once(args.out, "kill"):
                    os.kill(os.getpid(), signal.SIGKILL)
                if step == args.hang_at and once(args.out, "hang"):
                    (args.out / "hanging").write_text(str(os.getpid()))
                    time.sleep(3600)  # until the test kills this node
            if self.simigrad.local_samples:  # 0: a zero-weight padding sample, no sample of the step
                self.fed += batch[0].tolist()
            self.micro += 1
            time.sleep(args.step_sleep)

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
            row = self.simigrad.history[-1]
            self.write(
                event="step",
                step=int(row["step"]),
                samples=self.fed,
                epoch=self.simigrad.schedule.current.epoch,  # type: ignore[union-attr]
                **{k: row[k] for k in ("batch_size", "similarity", "samples_seen", "lr_scale")},
            )
            self.fed, self.micro = [], 0

    if args.crash_writing is not None:
        crash_while_writing(args.out, args.crash_writing)

    pl.seed_everything(0)
    elastic = None
    if args.elastic is not None:
        elastic = Elastic(
            max_accumulation=args.elastic, devices_per_node=1, max_nodes=2, patience=2, on_request="continue"
        )
        args.devices, args.nodes = 1, int(os.environ["WORLD_SIZE"])
    simigrad = SimiGrad(
        target_similarity=0.9, smoothing=0.5, max_batch_size=120, max_micro_batch_size=6, elastic=elastic
    )
    checkpoint = ModelCheckpoint(
        dirpath=args.out / "checkpoints",
        filename="{step}",
        every_n_train_steps=args.every,
        save_top_k=-1,
        save_last=True,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp" if args.devices * args.nodes > 1 else "auto",
        devices=args.devices,
        num_nodes=args.nodes,
        max_epochs=args.epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[simigrad, checkpoint, Log()],
    )
    model = Regressor(dropout=0.2)  # random draws in every step: each rank's generators must be restored
    trainer.fit(
        model,
        DataLoader(IndexedRegression(N), batch_size=B0 // max(trainer.world_size, 1), shuffle=True),
        ckpt_path="last",
    )
    log = next(c for c in trainer.callbacks if isinstance(c, Log))  # type: ignore[attr-defined]
    log.write(event="done", steps=simigrad.steps)
    if trainer.global_rank == 0:
        torch.save(model.state_dict(), args.out / f"final.pid{os.getpid()}.pt")
    if dist.is_initialized():
        # without it a worker dies at interpreter exit now and then (exit -6), which torchrun counts as a failure
        dist.destroy_process_group()


def crash_while_writing(out: Path, k: int) -> None:
    """SIGKILL this process halfway through writing its ``k``-th checkpoint file (Lightning writes them through
    fsspec, into a temporary file that it moves into place once complete)."""
    from fsspec.implementations.local import LocalFileOpener

    write = LocalFileOpener.write
    written = [0]

    def write_then_die(self: Any, data: bytes) -> int:
        written[0] += str(self.path).endswith(".ckpt")
        if written[0] == k and once(out, "crash"):
            write(self, data[: len(data) // 2])
            self.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return write(self, data)

    LocalFileOpener.write = write_then_die  # type: ignore[method-assign]


if __name__ == "__main__":
    main(sys.argv[1:])

"""Step time and traffic of ``SimiGrad(adjust=False)`` under FSDP against plain FSDP training, through Lightning.

Run (about 6 minutes on 2 CPU cores; ``--quick``: about 2 minutes, most of it starting processes)::

    .venv/bin/python benchmarks/fsdp_overhead.py                 # W = 2 and 4, FSDP2 then FSDP1, gloo on loopback
    .venv/bin/python benchmarks/fsdp_overhead.py --quick         # fewer rounds and steps
    .venv/bin/python benchmarks/fsdp_overhead.py --world-sizes 2 --rounds 3 --fsdp 1
    .venv/bin/python benchmarks/fsdp_overhead.py --fsdp --zero 1 2 --world-sizes 2   # DeepSpeed's ZeRO 1 and 2

For each world size W, W CPU processes (one thread each) are started here and joined to one gloo group; Lightning
treats them as launched externally (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE`` set) and skips its own launch and
``init_process_group``. In those processes, Lightning fits under
``ModelParallelStrategy(data_parallel_size=W, tensor_parallel_size=1)`` alternate, in a rotating order, between

(a) plain FSDP2: ``accumulate_grad_batches=K``, micro-batch M, so every optimizer step averages K*M*W samples;
(b) the same with ``SimiGrad(adjust=False, initial_batch_size=K*M*W, max_micro_batch_size=M)``: the same fixed
    batch and the same windows of K micro-batches per rank, measured at every step.

The model is a small transformer encoder (token embedding, 4 encoder layers, a vocabulary head; ~0.9M parameters,
3.7 MB in float32) with ``fully_shard`` applied to every encoder layer, then to the root. Both variants build it from
the same seed and see the same data. FSDP2 under Lightning reduce-scatters the gradient on every micro-batch (the
sharded ``p.grad`` accumulates), so (a) and (b) move the same gradient bytes; what SimiGrad adds is what this
benchmark shows.

``--fsdp 1`` runs the same under FSDP1: Lightning's ``FSDPStrategy`` (through
:class:`lightning_simigrad.testing.CPUFSDPStrategy`, which passes the CPU device), every encoder layer its own unit
(``ModuleWrapPolicy``), ``FULL_SHARD``. Plain FSDP1 accumulates inside ``no_sync`` and reduce-scatters once per
window; SimiGrad's measurement reduces at the window's midpoint too, so (b) sends a second reduce-scatter per step.

``--zero 1 2`` runs the same under DeepSpeed's ZeRO stages 1 and 2: Lightning's ``DeepSpeedStrategy`` (through
:class:`lightning_simigrad.testing.CPUDeepSpeedStrategy`), (a) with ``accumulate_grad_batches=K`` (DeepSpeed's own
accumulation). ZeRO-2 reduces every micro-batch, so (a) and (b) move the same bytes; ZeRO-1 reduces at the boundary
only, and SimiGrad's midpoint is a boundary too, so (b) reduces twice per step.

A step's time is the interval between two optimizer steps seen on rank 0 (every step ends in collectives, so the
ranks move together); its CPU time is ``time.process_time()`` over the same interval (every thread of the process,
gloo's included), summed over the ranks: on a machine shared with other work the CPU time moves less than the wall
time. Traffic is counted two ways:

- collective payloads: in the benchmark's processes only, every ``torch.distributed`` collective entry point
  (``all_reduce``, ``all_gather_single``, ``reduce_scatter_single``, ``broadcast``, ...) is wrapped by a counter
  that records the call and the bytes of the tensors it is given, then calls the real function (nothing is mocked;
  nested calls count once). The table gives the calls per step and the bytes each rank sends per step as a ring
  algorithm would: all-reduce 2(W-1)/W x n, reduce-scatter (W-1)/W x n of its input, all-gather (W-1) x its shard,
  broadcast n from the root. A collective issued without ``torch.distributed``'s Python functions (a functional
  collective, a ``ProcessGroup`` method) would not be counted: the second count catches that;
- loopback counters: the ``lo`` transmit bytes of ``/proc/net/dev`` between the first and last timed step, divided
  by W (the whole machine's loopback, so anything else running at the time adds to it; gloo's framing too).

The table printed last gives, per W, the median step times and CPU times, the medians of their per-round ratios
(b)/(a) and, per step, the extra collective calls and bytes of (b). On CPU/gloo the times are latency- and
Python-bound and say little about NCCL on GPUs. Measured figures: README, "Sharded training (FSDP)".
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _ports import reserve_port  # beside this file

VOCAB = 512
WIDTH = 128
LAYERS = 4
SEQUENCE = 32
MICRO_BATCH = 8
WINDOW = 2  # micro-batches per rank in every window (SimiGrad's time halves need >= 2)

# ----------------------------------------------------------------------------------- counting collectives

# entry point -> how many bytes a rank sends on a ring, from (payload bytes of its input, group size)
_RING = {
    "all_reduce": lambda n, w: 2 * (w - 1) / w * n,
    "all_reduce_coalesced": lambda n, w: 2 * (w - 1) / w * n,
    "reduce_scatter_single": lambda n, w: (w - 1) / w * n,
    "reduce_scatter_tensor": lambda n, w: (w - 1) / w * n,
    "reduce_scatter": lambda n, w: (w - 1) / w * n,
    "all_gather_single": lambda n, w: (w - 1) * n,
    "all_gather_into_tensor": lambda n, w: (w - 1) * n,
    "all_gather": lambda n, w: (w - 1) * n,
    "all_gather_object": lambda n, w: (w - 1) * n,
    "all_to_all_single": lambda n, w: (w - 1) / w * n,
    "all_to_all": lambda n, w: (w - 1) / w * n,
    "broadcast": lambda n, w: n,
    "broadcast_object_list": lambda n, w: n,
    "reduce": lambda n, w: n,
    "gather": lambda n, w: n,
    "scatter": lambda n, w: n,
    "send": lambda n, w: n,
    "isend": lambda n, w: n,
    "recv": lambda n, w: 0,
    "irecv": lambda n, w: 0,
    "barrier": lambda n, w: 0,
    "monitored_barrier": lambda n, w: 0,
}
# which argument is the rank's own contribution (the rest: the first tensor found)
_INPUT_ARGUMENT = {
    "all_gather_single": 1,
    "all_gather_into_tensor": 1,
    "all_gather": 1,
    "reduce_scatter_single": 1,
    "reduce_scatter_tensor": 1,
    "reduce_scatter": 1,
    "all_to_all_single": 1,
    "all_to_all": 1,
}


class CollectiveCounter:
    """Wraps ``torch.distributed``'s collective functions in this process: calls and ring bytes per entry point."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        self._depth = 0

    def install(self) -> None:
        for name in _RING:
            real = getattr(dist, name, None)
            if real is not None and not getattr(real, "_counted", False):
                wrapper = self._wrap(name, real)
                setattr(dist, name, wrapper)
                if getattr(dist.distributed_c10d, name, None) is real:
                    setattr(dist.distributed_c10d, name, wrapper)

    def _wrap(self, name: str, real: Any) -> Any:
        @functools.wraps(real)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.calls[name] += 1
                payload = _payload_bytes(name, args, kwargs)
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                self.bytes[name] += int(_RING[name](payload, dist.get_world_size(group)))
            self._depth += 1
            try:
                return real(*args, **kwargs)
            finally:
                self._depth -= 1

        counted._counted = True  # type: ignore[attr-defined]
        return counted

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        return dict(self.calls), dict(self.bytes)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _payload_bytes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    index = _INPUT_ARGUMENT.get(name)
    if index is not None and len(args) > index:
        return _tensor_bytes(args[index])
    for key in ("input", "input_tensor", "input_tensor_list", "tensor"):
        if key in kwargs:
            return _tensor_bytes(kwargs[key])
    return next((b for b in (_tensor_bytes(a) for a in args) if b), 0)


def _loopback_tx_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])
    return 0


# ----------------------------------------------------------------------------------- the model and the fits


def _module_class() -> type:
    import lightning.pytorch as pl
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    class Encoder(pl.LightningModule):
        """Tokens -> embedding -> LAYERS encoder layers -> vocabulary logits; ``fully_shard`` per layer, then root."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=4 * WIDTH, dropout=0.0, batch_first=True)
                for _ in range(LAYERS)
            )
            self.head = nn.Linear(WIDTH, VOCAB)

        def configure_model(self) -> None:
            if self.device_mesh is None:  # FSDP1: the strategy wraps the layers
                return
            mesh = self.device_mesh["data_parallel"]
            for layer in self.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            # FSDP2 gathers the root's parameters (embedding, head) around the root's forward only
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.cross_entropy(self(batch[0]).flatten(0, 1), batch[1].flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    return Encoder


def _strategy(name: str, world: int) -> Any:
    """``fsdp2``, ``fsdp1``, or DeepSpeed's ``zero1`` / ``zero2``."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch import nn
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lightning_simigrad.testing import CPUDeepSpeedStrategy, CPUFSDPStrategy

    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, process_group_backend="gloo")
    if name.startswith("zero"):
        return CPUDeepSpeedStrategy(stage=int(name[-1]), process_group_backend="gloo")
    wrap = ModuleWrapPolicy({nn.TransformerEncoderLayer})
    return CPUFSDPStrategy(process_group_backend="gloo", auto_wrap_policy=wrap, sharding_strategy="FULL_SHARD")


def _fit(variant: str, name: str, world: int, warmup: int, timed: int, counter: CollectiveCounter) -> dict[str, Any]:
    """One Lightning fit of ``warmup + timed`` optimizer steps; per timed step: time, calls and bytes."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_simigrad import SimiGrad

    steps = warmup + timed + 1
    gen = torch.Generator().manual_seed(0)
    n = MICRO_BATCH * WINDOW * world * (steps + 1)
    tokens = torch.randint(0, VOCAB, (n, SEQUENCE), generator=gen)
    data = TensorDataset(tokens, torch.roll(tokens, 1, dims=1))

    class Clock(pl.Callback):
        """At each new optimizer step (seen on the micro-batch after it): time, collectives, loopback bytes."""

        def __init__(self) -> None:
            self.marks: list[tuple[float, dict[str, int], dict[str, int], int, float]] = []
            self.last_step = -1

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step != self.last_step:
                self.last_step = trainer.global_step
                stamp = time.perf_counter()
                self.marks.append((stamp, *counter.snapshot(), _loopback_tx_bytes(), time.process_time()))

    clock = Clock()
    callbacks: list[pl.Callback] = [clock]
    if variant == "simigrad":
        batch = MICRO_BATCH * WINDOW * world
        callbacks.insert(
            0,
            SimiGrad(
                target_similarity=0.8,
                adjust=False,
                initial_batch_size=batch,
                max_micro_batch_size=MICRO_BATCH,
                progress_bar=False,
            ),
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        strategy=_strategy(name, world),
        max_steps=steps,
        accumulate_grad_batches=WINDOW if variant == "plain" else 1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(_module_class()(), DataLoader(data, batch_size=MICRO_BATCH, shuffle=False))
    marks = clock.marks[warmup:]
    first, last = marks[0], marks[-1]
    count = len(marks) - 1
    calls = {k: (last[1].get(k, 0) - first[1].get(k, 0)) / count for k in last[1]}
    sent = {k: (last[2].get(k, 0) - first[2].get(k, 0)) / count for k in last[2]}
    return {
        "times": [b[0] - a[0] for a, b in zip(marks, marks[1:])],
        "cpu": [b[4] - a[4] for a, b in zip(marks, marks[1:])],  # this process's CPU time, all its threads
        "calls": {k: v for k, v in calls.items() if v},
        "bytes": {k: v for k, v in sent.items() if v},
        "loopback": (last[3] - first[3]) / count / world,
        "global_step": trainer.global_step,
    }


def _worker(rank: int, name: str, world: int, port: int, rounds: int, warmup: int, timed: int, results: Any) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    counter = CollectiveCounter()
    counter.install()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))
    fits: dict[str, list[dict[str, Any]]] = {"plain": [], "simigrad": []}
    orders = [("plain", "simigrad"), ("simigrad", "plain")]
    _fit("plain", name, world, 1, 1, counter)  # warm-up: imports, gloo connections, allocator
    for r in range(rounds):
        for variant in orders[r % 2]:
            fits[variant].append(_fit(variant, name, world, warmup, timed, counter))
    results.put((rank, fits))
    dist.barrier()
    dist.destroy_process_group()


def _params() -> int:
    return sum(p.numel() for p in _module_class()().parameters())


def _kb(value: float) -> str:
    return f"{value / 1e3:,.1f} kB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--fsdp", type=int, nargs="*", choices=[1, 2], default=[2, 1], help="FSDP versions to run")
    parser.add_argument(
        "--zero", type=int, nargs="*", choices=[1, 2], default=[], help="DeepSpeed ZeRO stages to run (needs DeepSpeed)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds of (a, b) per world size (default 4)")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps per fit (default 8)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 timed steps: a smoke run (about 1 minute)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 4)
    timed = args.steps or (3 if args.quick else 8)
    warmup = 1 if args.quick else 2

    params = _params()
    print(
        f"fsdp_overhead: {params / 1e6:.2f}M params ({params * 4 / 2**20:.1f} MiB fp32), {LAYERS} encoder layers "
        f"sharded one by one, micro-batch {MICRO_BATCH} x {SEQUENCE} tokens, {WINDOW} micro-batches per rank and "
        f"window; {rounds} rounds of {timed} timed steps; torch {torch.__version__}",
        flush=True,
    )
    context = mp.get_context("spawn")
    rows = []
    names = [f"fsdp{v}" for v in args.fsdp] + [f"zero{stage}" for stage in args.zero]
    for name, world in ((name, world) for name in names for world in args.world_sizes):
        results = context.SimpleQueue()
        started = time.perf_counter()
        mp.start_processes(
            _worker,
            args=(name, world, reserve_port(), rounds, warmup, timed, results),
            nprocs=world,
            start_method="spawn",
        )
        ranks = dict(results.get() for _ in range(world))
        fits = ranks[0]
        plain = [statistics.median(f["times"]) for f in fits["plain"]]
        simi = [statistics.median(f["times"]) for f in fits["simigrad"]]
        ratio = statistics.median(b / a for a, b in zip(plain, simi, strict=True))
        # CPU seconds per step, summed over the ranks: what the step costs, less exposed to other load than wall time
        cpu = {
            variant: [sum(statistics.median(ranks[r][variant][i]["cpu"]) for r in range(world)) for i in range(rounds)]
            for variant in ("plain", "simigrad")
        }
        cpu_ratio = statistics.median(b / a for a, b in zip(cpu["plain"], cpu["simigrad"], strict=True))
        print(
            f"{name} W={world}: {rounds} rounds in {time.perf_counter() - started:.0f} s; "
            "per-round median step (a, b) ms: "
            + ", ".join(f"({a * 1e3:.0f}, {b * 1e3:.0f})" for a, b in zip(plain, simi, strict=True))
            + "; CPU ms per step, all ranks (a, b): "
            + ", ".join(f"({a * 1e3:.0f}, {b * 1e3:.0f})" for a, b in zip(cpu["plain"], cpu["simigrad"], strict=True)),
            flush=True,
        )
        for variant in ("plain", "simigrad"):
            last = fits[variant][-1]
            calls = ", ".join(f"{k} {v:g}" for k, v in sorted(last["calls"].items()))
            sent = ", ".join(f"{k} {_kb(v)}" for k, v in sorted(last["bytes"].items()))
            print(
                f"  {variant:8s} per step and rank: calls {calls}; ring bytes {sent}; loopback {_kb(last['loopback'])}",
                flush=True,
            )
        a, b = fits["plain"][-1], fits["simigrad"][-1]
        extra_calls = {k: b["calls"].get(k, 0) - a["calls"].get(k, 0) for k in set(a["calls"]) | set(b["calls"])}
        rows.append(
            (
                name,
                world,
                statistics.median(plain),
                statistics.median(simi),
                ratio,
                statistics.median(cpu["plain"]),
                statistics.median(cpu["simigrad"]),
                cpu_ratio,
                sum(a["bytes"].values()),
                sum(b["bytes"].values()),
                {k: v for k, v in extra_calls.items() if v},
                statistics.median(f["loopback"] for f in fits["plain"]),
                statistics.median(f["loopback"] for f in fits["simigrad"]),
            )
        )

    print()
    print(
        "strategy W | step (a) -> (b)     | median (b)/(a) | CPU/step, all ranks (a) -> (b) | median (b)/(a) "
        "| ring bytes/step/rank (a) -> (b)      | extra calls/step | loopback bytes/step/rank (a) -> (b)"
    )
    for name, world, ta, tb, ratio, ca, cb, cpu_ratio, ba, bb, extra, la, lb in rows:
        extra_text = ", ".join(f"{k} {v:+g}" for k, v in sorted(extra.items())) or "none"
        print(
            f"{name:>8s} {world:1d} | {ta * 1e3:5.0f} -> {tb * 1e3:5.0f} ms | {ratio:14.3f} | "
            f"{ca * 1e3:9.0f} -> {cb * 1e3:6.0f} ms         | {cpu_ratio:14.3f} | "
            f"{_kb(ba)} -> {_kb(bb)} ({bb - ba:+,.0f} B) | {extra_text} | {_kb(la)} -> {_kb(lb)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

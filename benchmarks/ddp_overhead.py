"""Step-time overhead of SimiGrad's DDP measurement against plain DDP and the paper's pattern.

Run (about 2-3 minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/ddp_overhead.py            # W = 2 and 4, gloo on loopback
    .venv/bin/python benchmarks/ddp_overhead.py --rounds 4 --world-sizes 2

For each world size W, W CPU processes (one thread each) train a ~10M-parameter MLP with windows of
4 micro-batches (`no_sync` for the first 3). Three DDP wrappers of identical copies of the model are
stepped alternately in the same processes, in a rotating order, so that machine noise hits all
variants alike:

(a) plain DDP;
(b) DDP + `RankGroupMeasurement`, armed every window, `collect()` after the backward;
(c) the paper's communication pattern, implemented honestly: in a comm hook, the world all-reduce
    plus an all-reduce of a copy of each bucket within each half group (both groups in parallel);
    after backward the first rank of group B sends its group's summed gradient to rank 0, which
    computes the dot products and broadcasts them.

A step is timed from a barrier to a barrier (the slowest rank) and includes an SGD update. The table
printed last gives, per W, the median step times and the medians of the per-round ratios (b)/(a)
and (c)/(a). On CPU/gloo the numbers are latency- and Python-bound and say little about NCCL.
"""

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _ports import reserve_port  # beside this file
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_simigrad.measurement.rank_groups import RankGroupMeasurement

WINDOW = 4
MICRO_BATCH = 32
WIDTH = 1024


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    # 1024*2048 + 2048*2048 + 2048*1024 + 1024*1024 + 1024*10 (+ biases) ~ 10.5M parameters
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(2 * WIDTH, 2 * WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(2 * WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 10),
    )


class PaperPattern:
    """The published code's communication per step: half all-reduce + full all-reduce + transfer to rank 0."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank
        self.size_a = world_size // 2
        self.leader_b = self.size_a
        groups = []
        for ranks in (list(range(self.size_a)), list(range(self.size_a, world_size))):
            groups.append(dist.new_group(ranks) if len(ranks) >= 2 else None)  # all ranks, same order
        self.half = groups[0] if rank < self.size_a else groups[1]
        self.half_sums: dict[int, torch.Tensor] = {}

    def hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer().mul_(1.0 / self.world_size)
        half_sum = buffer.clone()
        self.half_sums[bucket.index()] = half_sum
        futures = [dist.all_reduce(buffer, async_op=True).get_future()]  # type: ignore[union-attr]
        if self.half is not None:
            futures.append(dist.all_reduce(half_sum, group=self.half, async_op=True).get_future())  # type: ignore[union-attr]

        def finish(done: torch.futures.Future[list[torch.futures.Future[Any]]]) -> torch.Tensor:
            # collect_all's future carries no CUDA events: wait on each all-reduce, so that (on a GPU) the
            # current stream is ordered after them before DDP reads the bucket
            for future in done.value():
                future.wait()
            return buffer

        return torch.futures.collect_all(futures).then(finish)

    def after_backward(self) -> float:
        """Group B's gradient goes to rank 0 in full; rank 0 computes the cosine and broadcasts it."""
        flat = torch.cat([self.half_sums[i] for i in sorted(self.half_sums)])
        self.half_sums.clear()
        scalars = torch.zeros(3, dtype=torch.float64, device=flat.device)
        if self.rank == self.leader_b:
            dist.send(flat, dst=0)
        elif self.rank == 0:
            other = torch.empty_like(flat)
            dist.recv(other, src=self.leader_b)
            a, b = flat.double(), other.double()
            scalars = torch.stack([a @ b, a @ a, b @ b])
        dist.broadcast(scalars, src=0)
        dot, sq_a, sq_b = scalars.tolist()
        return dot / (sq_a * sq_b) ** 0.5


def _step(
    model: DDP,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    world_size: int,
    before_sync: Callable[[], None] = lambda: None,
    after_sync: Callable[[], Any] = lambda: None,
) -> float:
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    n = MICRO_BATCH * WINDOW * world_size
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        if last:
            before_sync()
        context = model.no_sync() if not last else _nullcontext()
        with context:
            loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum") * (world_size / n)
            loss.backward()
    after_sync()
    optimizer.step()
    dist.barrier()
    return time.perf_counter() - start


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def _worker(rank: int, world_size: int, port: int, rounds: int, results: Any) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=5))
    models = {name: DDP(_mlp()) for name in ("a", "b", "c")}  # identical copies (seeded init)
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-4) for name, m in models.items()}
    measurement = RankGroupMeasurement()
    measurement.register(models["b"])
    paper = PaperPattern(world_size, rank)
    models["c"].register_comm_hook(state=None, hook=paper.hook)
    counts = [MICRO_BATCH * WINDOW] * world_size

    gen = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(MICRO_BATCH, WIDTH, generator=gen), torch.randint(0, 10, (MICRO_BATCH,), generator=gen))
        for _ in range(WINDOW)
    ]
    runners: dict[str, Callable[[], float]] = {
        "a": lambda: _step(models["a"], optimizers["a"], batches, world_size),
        "b": lambda: _step(
            models["b"],
            optimizers["b"],
            batches,
            world_size,
            before_sync=lambda: measurement.arm(counts),
            after_sync=measurement.collect,
        ),
        "c": lambda: _step(models["c"], optimizers["c"], batches, world_size, after_sync=paper.after_backward),
    }
    for name in "abcabc":  # warm-up: bucket rebuild, allocator, gloo connections
        runners[name]()
    times: dict[str, list[float]] = {name: [] for name in runners}
    orders = ["abc", "bca", "cab", "acb", "bac", "cba"]
    for r in range(rounds):
        for name in orders[r % len(orders)]:
            times[name].append(runners[name]())
    measurement.close()
    if rank == 0:
        results.put((world_size, sum(p.numel() for p in models["a"].parameters()), times))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds of (a, b, c) per world size")
    args = parser.parse_args()

    context = mp.get_context("spawn")
    rows = []
    for world_size in args.world_sizes:
        results = context.SimpleQueue()
        started = time.perf_counter()
        mp.start_processes(
            _worker, args=(world_size, reserve_port(), args.rounds, results), nprocs=world_size, start_method="spawn"
        )
        _, n_params, times = results.get()
        ratio_b = statistics.median(b / a for a, b in zip(times["a"], times["b"], strict=True))
        ratio_c = statistics.median(c / a for a, c in zip(times["a"], times["c"], strict=True))
        print(
            f"W={world_size}: {n_params / 1e6:.1f}M params, {args.rounds} rounds in "
            f"{time.perf_counter() - started:.0f} s; per-round (a, b, c) ms: "
            + ", ".join(
                f"({a * 1e3:.0f}, {b * 1e3:.0f}, {c * 1e3:.0f})"
                for a, b, c in zip(times["a"], times["b"], times["c"], strict=True)
            ),
            flush=True,
        )
        medians = {name: statistics.median(values) for name, values in times.items()}
        rows.append((world_size, medians["a"], medians["b"], medians["c"], ratio_b, ratio_c))

    print()
    print("  W | plain DDP (a) | + measurement (b) | paper pattern (c) | median (b)/(a) | median (c)/(a)")
    print("----+---------------+-------------------+-------------------+----------------+---------------")
    for world_size, a, b, c, ratio_b, ratio_c in rows:
        print(
            f"{world_size:3d} | {a * 1e3:10.0f} ms | {b * 1e3:14.0f} ms | {c * 1e3:14.0f} ms "
            f"| {ratio_b:14.3f} | {ratio_c:14.3f}"
        )


if __name__ == "__main__":
    main()

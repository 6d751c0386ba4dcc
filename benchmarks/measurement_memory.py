"""Extra memory of the DDP measurement on CPU, per rank, against the bound the design states.

    python benchmarks/measurement_memory.py                  # W = 2, 3, 4; about two minutes on 2 cores
    python benchmarks/measurement_memory.py --world-sizes 4

For each W, two process groups run the same 6 windows of a ~25M-parameter MLP (a 100 MB float32
gradient, DDP's default 25 MB buckets): plain DDP, then DDP with `RankGroupMeasurement` armed every
window. Each rank reports its peak resident memory (`ru_maxrss`, which also sees short-lived buffers but
scatters by some 30 MiB between processes) and the bytes malloc has handed out and not taken back after the
last backward (`mallinfo2`, exact, but blind to what was freed before); the differences are what the
measurement costs there. The bound (see `lightning_simigrad/measurement/rank_groups.py`, "Memory"): nothing at
W = 2 and on group B's ranks; at W = 3 one gradient on rank 0; at W >= 4 on group A's ranks one gradient for the
receive buffers plus, under gloo, one for the copies sent -- on CPU all kept between windows, so the
bound is reached -- plus the dot products' chunk scratch (2 MiB per thread).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import datetime
import multiprocessing
import os
import resource

import torch
import torch.distributed as dist
from _ports import reserve_port  # beside this file
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_simigrad.measurement import _dots
from lightning_simigrad.measurement.rank_groups import RankGroupMeasurement

WIDTH = 2048


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, WIDTH), torch.nn.ReLU()]
    for _ in range(5):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back (heap and mmap), in every thread."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _worker(rank: int, world: int, port: int, measured: bool, out: multiprocessing.Queue) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))
    model = DDP(copy.deepcopy(_mlp()))
    measurement = RankGroupMeasurement() if measured else None
    if measurement is not None:
        measurement.register(model)
    x, y = torch.randn(16, 1024), torch.randint(0, 10, (16,))
    for _ in range(6):
        model.zero_grad(set_to_none=False)  # gradients stay allocated, as under Lightning
        if measurement is not None:
            measurement.arm([16] * world)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        in_use = _in_use()
        if measurement is not None:
            measurement.collect()
    gradient = sum(p.numel() * p.element_size() for p in model.parameters())
    out.put((rank, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, in_use, gradient))
    dist.barrier()
    dist.destroy_process_group()


def _peaks(world: int, measured: bool) -> tuple[list[int], list[int], int]:
    context = multiprocessing.get_context("forkserver")
    out = context.Queue()
    port = reserve_port()
    processes = [context.Process(target=_worker, args=(r, world, port, measured, out)) for r in range(world)]
    for p in processes:
        p.start()
    results = sorted(out.get(timeout=600) for _ in processes)
    for p in processes:
        p.join(timeout=60)
    return [r[1] for r in results], [r[2] for r in results], results[0][3]


def bound(world: int, rank: int, gradient: int) -> int:
    """The stated extra memory of ``rank`` on CPU/gloo, buffers kept between windows."""
    scratch = 2 * _dots.scratch_bytes(torch.device("cpu"))  # the autograd thread and a gloo thread
    size_a = world // 2
    if world == 2 or rank >= max(size_a, 1) or (world == 3 and rank != 0):
        return scratch
    return (1 if world == 3 else 2) * gradient + scratch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    args = parser.parse_args()
    preload = ["torch", "lightning_simigrad.measurement.rank_groups"]
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    mib = 2**20
    print(" W | rank | group | peak RSS plain / measured | extra | in use, extra | bound | in-use extra / gradient")
    print("---+------+-------+---------------------------+-------+---------------+-------+------------------------")
    for world in args.world_sizes:
        plain, plain_in_use, gradient = _peaks(world, measured=False)
        measured, measured_in_use, _ = _peaks(world, measured=True)
        for rank in range(world):
            extra, kept = measured[rank] - plain[rank], measured_in_use[rank] - plain_in_use[rank]
            print(
                f"{world:2d} | {rank:4d} | {'A' if rank < world // 2 else 'B':>5} | {plain[rank] / mib:12.0f} /"
                f" {measured[rank] / mib:10.0f} | {extra / mib:5.0f} | {kept / mib:13.1f} |"
                f" {bound(world, rank, gradient) / mib:5.0f} | {kept / gradient:6.3f}",
                flush=True,
            )
    print(f"(MiB; gradient {gradient / mib:.0f} MiB in 25 MB buckets)")


if __name__ == "__main__":
    main()

"""Check lightning_simigrad on this machine's GPUs: one command, a pass/fail table with figures.

    python benchmarks/gpu_check.py           # every check this node's GPUs allow (about 5 minutes on 8 GPUs)
    python benchmarks/gpu_check.py --quick   # small models, few steps: a one-minute smoke run

With one GPU:
- the one-process measurement (the window's halves) equals a float64 reference, in fp32, ``16-mixed``
  (with a GradScaler) and ``bf16-mixed``;
- step time of ``SimiGrad(adjust=False)`` against plain accumulation through Lightning, for a torchvision
  ResNet-50 at micro-batch 64 and a BERT-base masked LM (from a config, no weights) at micro-batch 32
  (goal <= 1.02), and the peak extra memory.

With two GPUs or more (NCCL), in one group of every GPU, for every W from 2 to the number of GPUs (DDP on a
subgroup): per-step gradients bitwise equal to plain DDP, statistics equal to a float64 reference gathered
from every rank, one host synchronisation in ``collect()`` and none in the hook; the stream race provoked
deliberately (the measurement stream held back by ``torch.cuda._sleep`` while the backward scribbles NaN
into fresh allocations) and shown harmless; a soak of measured steps with many small buckets; the DDP step
time against plain DDP and against the paper's communication pattern.

With one GPU, also two processes with gloo on CUDA tensors of that GPU (the measurement stream, CUDA futures
and ``record_stream`` without NCCL). With two GPUs or more, also a Lightning ``strategy="ddp"`` fit through
``SimiGrad`` in ``16-mixed`` and ``bf16-mixed`` (Lightning builds DDP under a side stream of its own, so the
hook runs on another stream than ``collect()``; ``gpu_check_fit.py`` beside this file), and a Lightning
``ModelParallelStrategy`` (FSDP2) fit on every GPU, ``fully_shard`` per layer then the root, and a Lightning
``FSDPStrategy`` (FSDP1) fit, every ``Linear`` its own unit (float64 under FSDP2; FSDP1 computes in float32, the
only full precision Lightning's FSDP precision offers), with every step audited by
``lightning_simigrad.testing.StepAudit``: the gradient applied against the mean loss over exactly the samples the
step fed, the logged similarity against the reference similarity of the window's halves in time.

Every property it could not check on this machine gets a row too, ``SKIPPED``, with the reason.

Without a GPU it says so in one line and exits 0. ``tests/distributed/test_gpu_check.py`` runs the same code with
``device="cpu"`` (gloo, small sizes), so the GPU paths cannot wait for a GPU to show a typo.
Exit code: 1 if a correctness check failed (FAIL); performance goals are reported as MET or MISSED (a timing
that does not finish is MISSED), and SKIPPED rows never fail the run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ddp_overhead and _ports, beside this file
from _ports import reserve_port  # noqa: E402
from ddp_overhead import PaperPattern  # noqa: E402

from lightning_simigrad import Window  # noqa: E402
from lightning_simigrad.measurement import _ddp_hook, loss_scale_of, window_halves  # noqa: E402
from lightning_simigrad.measurement.rank_groups import RankGroupMeasurement  # noqa: E402
from lightning_simigrad.testing import HostSyncs, flat_grad, reference_halves, relative_error, run_window  # noqa: E402

START_METHOD = "forkserver"  # CUDA needs a fresh process; the server imports torch once for all ranks
# Relative error allowed against the float64 references: DDP's mean gradient is rounded to float32 and, on
# CPU, chunk products are float32 (a race or a lost bucket shows as an error of order 1, or NaN).
TOLERANCE = 1e-5


@dataclass
class Row:
    check: str
    status: str  # PASS / FAIL, MET / MISSED for a performance goal, SKIPPED for what this machine cannot check
    figure: str


# ----------------------------------------------------------------------------------- shared helpers


# ----------------------------------------------------------------------------------- one process


def check_one_process(device: str) -> list[Row]:
    """The window-halves measurement on ``device`` against float64 products of the halves, per precision."""
    rows = []
    for precision in ("32", "16-mixed", "bf16-mixed"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8)).to(device)
        params = list(net.parameters())
        dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(precision)
        scaler = torch.amp.GradScaler(device, init_scale=1024.0) if precision == "16-mixed" else None
        halves, sizes = window_halves(), [16, 16, 8, 24]
        window = Window(tuple((n,) for n in sizes))  # the halves: micro-batches 0-1 and 2-3, 32 samples each
        copies, fed = [], [0, 0]
        for j, n in enumerate(sizes):
            halves.start_micro_batch(window, j, params)
            x, y = torch.randn(n, 64, device=device), torch.randn(n, 8, device=device)
            with torch.autocast(device_type=torch.device(device).type, dtype=dtype, enabled=dtype is not None):
                loss = nn.functional.mse_loss(net(x).float(), y) * (n / sum(sizes))
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if j in (1, 3):  # the reference keeps its own copy of each half (the measurement keeps none)
                copies.append([p.grad.detach().to(torch.float64).clone() for p in params])
            fed[j >= window.half_split()] += n
            halves.after_backward(window, j, (fed[0], fed[1]), params)
        stats = halves.collect(loss_scale_of(scaler))  # the scale tensor is read with the products: one read
        s, r = (torch.cat([g.reshape(-1) for g in half]) for half in copies)
        f = 2.0 * (float(1.0 / scaler.get_scale()) if scaler is not None else 1.0)  # g_A = (N / n_A) s, unscaled
        reference = (float(s @ r) * f * f, float(s @ s) * f * f, float(r @ r) * f * f)
        error = relative_error(stats, reference)
        ok = error < TOLERANCE and stats.is_finite
        rows.append(
            Row(
                f"one process, {precision}: statistics = float64 reference",
                "PASS" if ok else "FAIL",
                f"rel. error {error:.1e}",
            )
        )
    return rows


def check_step_time(device: str, quick: bool) -> list[Row]:
    """SimiGrad(adjust=False) against plain accumulation through Lightning, ResNet-50 and BERT-base."""
    rows = []
    threads = torch.get_num_threads()
    if device == "cpu":  # on a shared CPU, intra-op threads oversubscribe the cores (20x slower here)
        torch.set_num_threads(1)
    try:
        measured = {name: _lightning_step_times(name, device, quick) for name in ("resnet50", "bert_base")}
    finally:
        torch.set_num_threads(threads)
    for name, (times, peaks, params) in measured.items():
        ratio = statistics.median(times["simigrad"]) / statistics.median(times["plain"])
        figure = (
            f"{statistics.median(times['plain']) * 1e3:.1f} / {statistics.median(times['simigrad']) * 1e3:.1f} ms"
            f" per step, ratio {ratio:.3f}"
        )
        rows.append(
            Row(f"{name}: step time SimiGrad / plain (goal <= 1.02)", "MET" if ratio <= 1.02 else "MISSED", figure)
        )
        if peaks:
            extra = max(peaks["simigrad"]) - max(peaks["plain"])
            gradient = params * 4
            rows.append(
                Row(
                    f"{name}: peak extra memory (bound: one gradient)",
                    "PASS" if extra <= gradient + 64 * 2**20 else "FAIL",
                    f"{extra / 2**20:.0f} MiB = {extra / gradient:.2f} x the gradient",
                )
            )
    return rows


def _lightning_step_times(
    name: str, device: str, quick: bool
) -> tuple[dict[str, list[float]], dict[str, list[int]], int]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_simigrad import SimiGrad

    cuda = device == "cuda"
    micro, window = (2, 2) if quick else ((64, 4) if name == "resnet50" else (32, 4))
    if name == "resnet50":
        import torchvision

        side = 32 if quick else 224
        model: nn.Module = torchvision.models.resnet50(num_classes=10 if quick else 1000)
        data = TensorDataset(
            torch.randn(micro * window * 8, 3, side, side), torch.randint(0, 10, (micro * window * 8,))
        )

        def loss_of(module: nn.Module, batch: Any) -> torch.Tensor:
            return nn.functional.cross_entropy(module(batch[0]), batch[1])
    else:
        from transformers import BertConfig, BertForMaskedLM

        config = (
            BertConfig(
                hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=1000
            )
            if quick
            else BertConfig()
        )
        model = BertForMaskedLM(config)
        length = 16 if quick else 128
        tokens = torch.randint(0, config.vocab_size, (micro * window * 8, length))
        data = TensorDataset(tokens, tokens.clone())

        def loss_of(module: nn.Module, batch: Any) -> torch.Tensor:
            return module(input_ids=batch[0], labels=batch[1]).loss

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = copy.deepcopy(model)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return loss_of(self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    class StepClock(pl.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.stamps.append(time.perf_counter())

    warmup, timed = (1, 2) if quick else (3, 12)
    times: dict[str, list[float]] = {"plain": [], "simigrad": []}
    peaks: dict[str, list[int]] = {"plain": [], "simigrad": []}
    for variant in ("plain", "simigrad", "plain", "simigrad")[: 2 if quick else 4]:
        clock = StepClock()
        callbacks: list[Any] = [clock]
        if variant == "simigrad":
            callbacks.append(
                SimiGrad(
                    target_similarity=0.8, adjust=False, initial_batch_size=micro * window, max_micro_batch_size=micro
                )
            )
        trainer = pl.Trainer(
            accelerator="gpu" if cuda else "cpu",
            devices=1,
            precision="bf16-mixed" if cuda else "32-true",
            max_steps=warmup + timed + 1,
            accumulate_grad_batches=window if variant == "plain" else 1,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        trainer.fit(Module(), DataLoader(data, batch_size=micro, shuffle=True))
        if cuda:
            peaks[variant].append(torch.cuda.max_memory_allocated())
        steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
        times[variant].extend(steps[warmup:])
    return times, (peaks if cuda else {}), sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------- DDP, one group of n


class _Scribble(torch.autograd.Function):
    """Identity forward; its backward allocates fresh memory and fills it with NaN (on the backward's
    stream), so that any block the measurement freed too early would be handed out and overwritten."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        for numel in (1, 4, 64, 4096, 1 << 16):
            torch.full((numel,), float("nan"), dtype=torch.float64, device=grad.device)
            torch.full((numel,), float("nan"), dtype=grad.dtype, device=grad.device)
        return grad


class _Net(nn.Module):
    def __init__(self, width: int, scribble: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            [nn.Linear(8, width), nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, 4)]
        )
        self.scribble = scribble

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(_Scribble.apply(x) if self.scribble else x)
        return x


def _batches(rank: int, seed: int, counts: list[int], device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = counts[rank]
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(n, 8, generator=gen)
    y = torch.randn(n, 4, generator=gen) + 3.0 * torch.sin(x[:, :4])  # correlated ranks: similarity well above 0
    sizes = [n // 3, n // 3, n - 2 * (n // 3)]
    out, start = [], 0
    for size in sizes:
        out.append((x[start : start + size].to(device), y[start : start + size].to(device)))
        start += size
    return out


def _exactness(
    rank: int, world: int, group: Any, device: torch.device, width: int, windows: int, scribble: bool
) -> dict[str, float]:
    """Plain DDP and measured DDP side by side on ``group``: bitwise gradients, reference statistics, syncs."""
    base = _Net(width, scribble).to(device)
    device_ids = [device.index] if device.type == "cuda" else None
    plain = DDP(copy.deepcopy(base), device_ids=device_ids, process_group=group, bucket_cap_mb=0.001)
    hooked = DDP(copy.deepcopy(base), device_ids=device_ids, process_group=group, bucket_cap_mb=0.001)
    local = copy.deepcopy(base)
    measurement = RankGroupMeasurement(process_group=group)
    measurement.register(hooked)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.05)
    worst, mismatched, syncs_hook, syncs_collect = 0.0, 0, 0, 0
    for window in range(windows):
        armed = window % 3 != 1  # every third window unarmed: plain averaging
        counts = [6 + r + window % 2 for r in range(world)]
        micro = _batches(rank, window, counts, device)
        for model in (plain, hooked, local):
            model.zero_grad(set_to_none=True)
        with HostSyncs(device) as plain_syncs:  # what DDP itself costs, to subtract
            run_window(plain, micro, counts, world)
        run_window(local, micro, counts, world)
        if armed:
            measurement.arm(counts)
        with HostSyncs(device) as hook_syncs:
            run_window(hooked, micro, counts, world)
        mismatched += sum(not torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), hooked.parameters()))
        with HostSyncs(device) as collect_syncs:
            stats = measurement.collect()
        reference = reference_halves(flat_grad(local), counts, group)
        if armed:
            worst = max(worst, relative_error(stats, reference))
            syncs_collect = max(syncs_collect, collect_syncs.count)
            if window >= 2:  # after DDP's bucket rebuild
                syncs_hook = max(syncs_hook, hook_syncs.count - plain_syncs.count)
        optimizer.step()
        with torch.no_grad():
            for a, b, c in zip(plain.parameters(), hooked.parameters(), local.parameters()):
                b.copy_(a)
                c.copy_(a)
    measurement.close()
    return {"mismatched": mismatched, "error": worst, "syncs_hook": syncs_hook, "syncs_collect": syncs_collect}


def _soak(rank: int, world: int, device: torch.device, steps: int) -> dict[str, float]:
    """Many measured steps with many small buckets: finite, identical on every rank, the reference now and then."""
    base = _Net(256).to(device)
    model = DDP(copy.deepcopy(base), device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=0.01)
    local = copy.deepcopy(base)
    measurement = RankGroupMeasurement()
    measurement.register(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start, bad, worst = time.perf_counter(), 0, 0.0
    for step in range(steps):
        counts = [8] * world
        micro = _batches(rank, step, counts, device)
        model.zero_grad(set_to_none=True)
        measurement.arm(counts)
        run_window(model, micro, counts, world)
        stats = measurement.collect()
        mine = torch.tensor([stats.dot, stats.sq_a, stats.sq_b], dtype=torch.float64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        bad += int(not stats.is_finite or not all(torch.equal(mine, other) for other in everyone))
        if step % 50 == 0 or step == steps - 1:
            local.load_state_dict({k.removeprefix("module."): v for k, v in model.state_dict().items()})
            local.zero_grad(set_to_none=True)
            run_window(local, micro, counts, world)
            worst = max(worst, relative_error(stats, reference_halves(flat_grad(local), counts)))
        optimizer.step()
    measurement.close()
    return {"bad": bad, "error": worst, "seconds": time.perf_counter() - start, "steps": steps}


def _ddp_times(
    rank: int, world: int, device: torch.device, width: int, micro_batch: int, rounds: int
) -> dict[str, float]:
    """Step time of plain DDP (a), DDP + the measurement (b), the paper's pattern (c), alternated."""
    models = {
        name: DDP(_Net(width).to(device), device_ids=[device.index] if device.type == "cuda" else None)
        for name in "abc"
    }
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-5) for name, m in models.items()}
    measurement = RankGroupMeasurement()
    measurement.register(models["b"])
    paper = PaperPattern(world, rank)
    models["c"].register_comm_hook(state=None, hook=paper.hook)
    counts = [micro_batch * 4] * world
    micro = [(torch.randn(micro_batch, 8, device=device), torch.randn(micro_batch, 4, device=device)) for _ in range(4)]

    def step(name: str) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        begin = time.perf_counter()
        models[name].zero_grad(set_to_none=True)
        if name == "b":
            measurement.arm(counts)
        run_window(models[name], micro, counts, world)
        if name == "b":
            measurement.collect()
        elif name == "c":
            paper.after_backward()
        optimizers[name].step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - begin

    for name in "abcabc":
        step(name)
    times: dict[str, list[float]] = {name: [] for name in "abc"}
    for r in range(rounds):
        for name in ("abc", "bca", "cab")[r % 3]:
            times[name].append(step(name))
    measurement.close()
    return {
        "a": statistics.median(times["a"]),
        "b/a": statistics.median(b / a for a, b in zip(times["a"], times["b"])),
        "c/a": statistics.median(c / a for a, c in zip(times["a"], times["c"])),
    }


def _ddp_worker(
    rank: int, world: int, port: int, device_type: str, quick: bool, out: Any, one_device: bool = False
) -> None:
    """``one_device``: every rank on the first device, over gloo (one GPU: CUDA tensors without NCCL), exactness
    and soak only."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    cuda = device_type == "cuda"
    device = torch.device("cuda", 0 if one_device else rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60 if quick else 120)
    backend = "nccl" if cuda and not one_device else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    results: dict[str, Any] = {}

    def publish() -> None:  # after every phase, so that a later hang still leaves the earlier rows
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            out.put(gathered)

    try:
        for w in range(2, world + 1):  # every rank creates every subgroup, in the same order
            group = dist.new_group(list(range(w)))
            if rank < w:
                results[f"exact W={w}"] = _exactness(rank, w, group, device, 32, 8 if quick else 12, scribble=False)
            dist.barrier()
        publish()
        if one_device:
            results["soak"] = _soak(rank, world, device, 12 if quick else 100)
            results["times"] = {}  # no timing: processes sharing one GPU say nothing about speed
            publish()
            return
        _ddp_hook.callback_delay = (lambda: torch.cuda._sleep(20_000_000)) if cuda else (lambda: time.sleep(0.002))
        results["race"] = _exactness(rank, world, None, device, 64, 4 if quick else 20, scribble=True)
        _ddp_hook.callback_delay = None
        results["soak"] = _soak(rank, world, device, 12 if quick else 300)
        publish()
        width, micro_batch = (64, 8) if quick else (4096, 256)
        # last: the paper's pattern drives two communicators at once, which NCCL may deadlock on
        results["times"] = _ddp_times(rank, world, device, width, micro_batch, 3 if quick else 15)
        publish()
    finally:
        dist.destroy_process_group()


def check_ddp(device: str, world: int, quick: bool, deadline_s: float = 420.0, one_device: bool = False) -> list[Row]:
    context = multiprocessing.get_context(START_METHOD)
    context.set_forkserver_preload(["torch", "lightning_simigrad.measurement.rank_groups"])
    out = context.Queue()
    port = reserve_port()
    processes = [
        context.Process(target=_ddp_worker, args=(rank, world, port, device, quick, out, one_device), daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    gathered, deadline = None, time.monotonic() + deadline_s
    while time.monotonic() < deadline and (gathered is None or "times" not in gathered[0]):
        with contextlib.suppress(queue.Empty):
            gathered = out.get(timeout=1.0)
        if not any(p.is_alive() for p in processes) and out.empty():
            break
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    label = f"{world} processes, gloo on one {device} device" if one_device else f"DDP on {world} {device} processes"
    if gathered is None:
        codes = [p.exitcode for p in processes]
        return [Row(label, "FAIL", f"no result within {deadline_s:.0f} s; exit codes {codes}")]
    rows = _ddp_rows(gathered, world, one_device)
    if one_device:
        rows = [Row(f"{label}: {row.check.split(': ', 1)[-1]}", row.status, row.figure) for row in rows]
    return rows


def _ddp_rows(gathered: list[dict[str, Any]], world: int, one_device: bool = False) -> list[Row]:
    rows = []
    for w in range(2, world + 1):
        parts = [r[f"exact W={w}"] for r in gathered[:w]]
        mismatched = sum(p["mismatched"] for p in parts)
        error = max(p["error"] for p in parts)
        ok = mismatched == 0 and error < TOLERANCE
        rows.append(
            Row(
                f"DDP W={w}: gradients bitwise = plain DDP, statistics = reference",
                "PASS" if ok else "FAIL",
                f"{mismatched} tensors differ; rel. error {error:.1e}",
            )
        )
        hook, collect = max(p["syncs_hook"] for p in parts), max(p["syncs_collect"] for p in parts)
        rows.append(
            Row(
                f"DDP W={w}: host synchronisations, hook / collect()",
                "PASS" if hook == 0 and collect <= 1 else "FAIL",
                f"{hook} / {collect} (goal 0 / 1)",
            )
        )
    if one_device:
        if "soak" not in gathered[0]:
            return [*rows, Row(f"DDP W={world}: soak", "FAIL", "did not finish (a hang or an error)")]
        return [*rows, _soak_row(gathered, world)]
    if "race" not in gathered[0]:
        return [*rows, Row(f"DDP W={world}: race and soak", "FAIL", "did not finish (a hang or an error)")]
    race = [r["race"] for r in gathered]
    ok = sum(p["mismatched"] for p in race) == 0 and max(p["error"] for p in race) < TOLERANCE
    rows.append(
        Row(
            f"DDP W={world}: measurement stream held back, NaN scribbled into fresh blocks",
            "PASS" if ok else "FAIL",
            f"rel. error {max(p['error'] for p in race):.1e}",
        )
    )
    rows.append(_soak_row(gathered, world))
    if "times" not in gathered[0]:
        # the timing runs last, beside the paper's pattern (two communicators at once, which NCCL may deadlock
        # on): a timing that does not finish is a goal not shown, not a fault of the package
        return [*rows, Row(f"DDP W={world}: step time measured / plain DDP (goal <= 1.10)", "MISSED", "did not finish")]
    times = gathered[0]["times"]
    rows.append(
        Row(
            f"DDP W={world}: step time measured / plain DDP (goal <= 1.10)",
            "MET" if times["b/a"] <= 1.10 else "MISSED",
            f"plain {times['a'] * 1e3:.1f} ms, ratio {times['b/a']:.3f}; paper's pattern {times['c/a']:.3f}",
        )
    )
    return rows


def _soak_row(gathered: list[dict[str, Any]], world: int) -> Row:
    soak = [r["soak"] for r in gathered]
    ok = sum(p["bad"] for p in soak) == 0 and max(p["error"] for p in soak) < TOLERANCE
    return Row(
        f"DDP W={world}: soak, many small buckets",
        "PASS" if ok else "FAIL",
        f"{sum(p['bad'] for p in soak)} bad steps of {soak[0]['steps']}; rel. error"
        f" {max(p['error'] for p in soak):.1e}; {soak[0]['seconds']:.0f} s",
    )


# ----------------------------------------------------------------------------------- Lightning's own DDP

FIT_PRECISIONS = ("16-mixed", "bf16-mixed")


def check_lightning_ddp(device: str, world: int, quick: bool, deadline_s: float = 240.0) -> list[Row]:
    """A Lightning ``strategy="ddp"`` fit through SimiGrad per precision, in a script of its own."""
    return [_lightning_fit_row(device, world, quick, "ddp", precision, deadline_s) for precision in FIT_PRECISIONS]


def check_lightning_deepspeed(device: str, world: int, quick: bool, deadline_s: float = 300.0) -> list[Row]:
    """A Lightning ``DeepSpeedStrategy`` fit through SimiGrad at ZeRO stages 1 and 2 (fp32, what is served)."""
    stages = ("deepspeed_stage_1", "deepspeed_stage_2")
    return [_lightning_fit_row(device, world, quick, stage, "32-true", deadline_s) for stage in stages]


def deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _lightning_fit_row(device: str, world: int, quick: bool, strategy: str, precision: str, deadline_s: float) -> Row:
    """``gpu_check_fit.py`` run once: every rank's steps finite and alike."""
    script = Path(__file__).resolve().parent / "gpu_check_fit.py"
    check = f"Lightning strategy='{strategy}', {world} {device} processes, {precision}: finite, identical on every rank"
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result.json")
        command = [sys.executable, str(script), "--accelerator", "gpu" if device == "cuda" else "cpu"]
        command += ["--devices", str(world), "--precision", precision, "--steps", "6" if quick else "20"]
        command += ["--strategy", strategy]
        try:
            # where rank 0 hosts the group's store (Lightning would take a port it bound and released)
            env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(reserve_port())}
            done = subprocess.run(command + ["--out", out], env=env, capture_output=True, text=True, timeout=deadline_s)
        except subprocess.TimeoutExpired:
            return Row(check, "FAIL", f"the fit did not finish within {deadline_s:.0f} s (a hang)")
        ranks = []
        for rank in range(world):
            with contextlib.suppress(OSError, ValueError), open(f"{out}.{rank}") as f:
                ranks.append(json.load(f))
    if done.returncode != 0 or len(ranks) != world:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        return Row(check, "FAIL", f"exit code {done.returncode}, {len(ranks)} of {world} ranks: {tail[0]}")
    first = ranks[0]
    same = all(r["similarities"] == first["similarities"] and r["parameters"] == first["parameters"] for r in ranks)
    similarities = first["similarities"]
    finite = sum(1 for v in similarities if v == v)
    # a step may go unmeasured (a GradScaler's skipped step, an epoch's short last window); most must measure
    ok = same and first["steps"] > 0 and finite >= max(1, len(similarities) - 2)
    return Row(
        check,
        "PASS" if ok else "FAIL",
        f"{first['steps']} steps, {finite} measured, batch {min(first['batch_sizes'])}.."
        f"{max(first['batch_sizes'])}, ranks {'identical' if same else 'DIFFER'}",
    )


# ----------------------------------------------------------------------------------- Lightning's FSDP2 and FSDP1

FSDP_CHECK = "Lightning ModelParallelStrategy (FSDP2)"
FSDP1_CHECK = "Lightning FSDPStrategy (FSDP1)"


def _fsdp_strategy(version: int, world: int, device: torch.device) -> Any:
    """FSDP2 through ModelParallelStrategy, or FSDP1 with every Linear its own unit (on CPU through the subclass that
    passes the CPU device, which Lightning's FSDPStrategy does not)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lightning_simigrad.testing import CPUFSDPStrategy

    if version == 2:
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    kind = FSDPStrategy if device.type == "cuda" else CPUFSDPStrategy
    return kind(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def _fsdp_fit(rank: int, world: int, device: torch.device, quick: bool, version: int) -> dict[str, Any]:
    """A float64 FSDP fit through SimiGrad, every step audited against a one-process reference (StepAudit)."""
    import lightning.pytorch as pl
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_simigrad import SimiGrad
    from lightning_simigrad.testing import StepAudit

    n = 128 if quick else 512
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen, dtype=torch.float64)
    y = torch.sin(x[:, :4]) + 0.5 * torch.randn(n, 4, generator=gen, dtype=torch.float64)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
            self.net.double()

        def configure_model(self) -> None:  # FSDP2: fully_shard per layer, then the root (FSDP1: the strategy wraps)
            if version == 2 and not getattr(self, "fully_sharded", False):
                mesh = self.device_mesh["data_parallel"]
                for layer in self.net[::2]:
                    fully_shard(layer, mesh=mesh)
                fully_shard(self, mesh=mesh)
                self.fully_sharded = True

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.net(inputs)

        def loss(self, indices: torch.Tensor) -> torch.Tensor:
            # FSDP1 computes in float32 (Lightning's FSDP precision has no float64); FSDP2 and the reference in float64
            like = next(self.net.parameters())
            indices = indices.cpu()
            return nn.functional.mse_loss(self(x[indices].to(like)), y[indices].to(like))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.loss(batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def mean_loss(module: nn.Module, indices: list[int]) -> torch.Tensor:
        return module.to(device).loss(torch.tensor(indices))  # type: ignore[operator]

    audit = StepAudit(indices=lambda batch: batch[0].tolist(), mean_loss=mean_loss)
    simigrad = SimiGrad(target_similarity=0.9, max_micro_batch_size=8, progress_bar=False)
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=world,
        num_nodes=1,
        strategy=_fsdp_strategy(version, world, device),
        max_epochs=1 if quick else 2,
        callbacks=[simigrad, audit],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), DataLoader(TensorDataset(torch.arange(n)), batch_size=8, shuffle=True))
    history = list(simigrad.history)
    measured = [
        abs(h["similarity"] - s.similarity)
        for h, s in zip(history, audit.steps)
        if math.isfinite(h["similarity"]) and math.isfinite(s.similarity)
    ]
    return {
        "steps": len(history),
        "audited": len(audit.steps),
        "measured": len(measured),
        "similarity_error": max(measured, default=math.nan),
        "grad_error": max((s.grad_rel_error for s in audit.steps), default=math.nan),
        "identical": all(s.ranks_identical for s in audit.steps),
        "batches_match": all(len(s.samples) == h["batch_size"] for h, s in zip(history, audit.steps)),
        "batch_sizes": [int(h["batch_size"]) for h in history],
        "history": [[h["batch_size"], h["similarity"]] for h in history],
        "measurement": type(simigrad.run.measurement).__name__ if simigrad.run is not None else None,
    }


def _fsdp_worker(rank: int, world: int, port: int, device_type: str, quick: bool, version: int, out: Any) -> None:
    """One rank, launched here and joined to the group before Lightning runs (Lightning then skips its launch)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
        WORLD_SIZE=str(world), NODE_RANK="0",
    )  # fmt: skip
    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60 if quick else 120)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        try:
            result = _fsdp_fit(rank, world, device, quick, version)
        except Exception as err:  # a refusal or a fault of the package is a row, not a traceback
            out.put([{"error": f"rank {rank}: {type(err).__name__}: {str(err).splitlines()[0][:200]}"}])
            return
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            out.put(gathered)
    finally:
        dist.destroy_process_group()


def check_fsdp(device: str, world: int, quick: bool, version: int = 2, deadline_s: float = 300.0) -> list[Row]:
    """A Lightning FSDP fit through SimiGrad, float64, every step audited: the gradient applied against the mean loss
    over exactly the samples the step fed, and the logged similarity against the reference similarity of the window's
    two halves in time. ``version`` 2: ModelParallelStrategy, fully_shard per layer, then the root; 1: FSDPStrategy,
    every Linear its own unit."""
    check = f"{FSDP_CHECK if version == 2 else FSDP1_CHECK}, {world} {device} processes: gradients and similarity"
    check += " = reference"
    context = multiprocessing.get_context(START_METHOD)
    out = context.Queue()
    port = reserve_port()
    processes = [
        context.Process(target=_fsdp_worker, args=(rank, world, port, device, quick, version, out), daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    gathered, deadline = None, time.monotonic() + deadline_s
    while time.monotonic() < deadline and gathered is None:
        with contextlib.suppress(queue.Empty):
            gathered = out.get(timeout=1.0)
        if gathered is None and not any(p.is_alive() for p in processes) and out.empty():
            break
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    if gathered is None:
        codes = [p.exitcode for p in processes]
        return [Row(check, "FAIL", f"no result within {deadline_s:.0f} s (a hang or a crash); exit codes {codes}")]
    if "error" in gathered[0]:
        return [Row(check, "FAIL", gathered[0]["error"])]
    first = gathered[0]
    same = all(json.dumps(r["history"]) == json.dumps(first["history"]) for r in gathered)
    ok = (
        same
        and first["steps"] > 0
        and first["audited"] == first["steps"]
        and first["batches_match"]
        and first["identical"]
        and first["grad_error"] < (1e-6 if version == 2 else 1e-4)  # float64 throughout; FSDP1 computes in float32
        and first["measured"] >= max(1, first["steps"] - 2)  # only an epoch's short tail goes unmeasured
        and first["similarity_error"] < (1e-5 if version == 2 else 1e-4)
    )
    sizes = first["batch_sizes"]
    ranks = "identical" if same and first["identical"] else "DIFFER"
    return [
        Row(
            check,
            "PASS" if ok else "FAIL",
            f"{first['steps']} steps ({first['measured']} measured, {first['measurement']}), batch"
            f" {min(sizes, default=0)}..{max(sizes, default=0)}; rel. error {first['grad_error']:.1e},"
            f" similarity {first['similarity_error']:.1e}; ranks {ranks}",
        )
    ]


# ----------------------------------------------------------------------------------- what was not checked


def skipped_rows(device: str, world: int) -> list[Row]:
    """A row for every property this machine cannot check, and why."""
    rows = []
    if not deepspeed_installed():
        why = "DeepSpeed is not installed (pip install --no-build-isolation 'deepspeed>=0.19,<0.20')"
        rows.append(Row("Lightning DeepSpeedStrategy, ZeRO stages 1 and 2", "SKIPPED", why))
    if device != "cuda":
        why = "needs CUDA; this run is on CPU"
        rows.append(Row("measurement stream, CUDA futures, record_stream, NCCL stream order", "SKIPPED", why))
        rows.append(Row("peak extra memory (bound: one gradient)", "SKIPPED", "needs CUDA's allocator statistics"))
    if device == "cuda" and world < 2:
        why = f"needs >= 2 GPUs; this node has {world}"
        rows.append(Row("DDP on NCCL, W = 2..GPUs: gradients, statistics, host synchronisations", "SKIPPED", why))
        rows.append(Row("DDP on NCCL: stream race held back, soak, step time", "SKIPPED", why))
        for precision in FIT_PRECISIONS:
            rows.append(Row(f"Lightning strategy='ddp', {precision}", "SKIPPED", why))
        for name in (FSDP_CHECK, FSDP1_CHECK):
            rows.append(Row(f"{name} on NCCL: gradients and similarity = reference", "SKIPPED", why))
    if device == "cuda" and world >= 2:
        rows.append(
            Row(f"{2} processes, gloo on one GPU", "SKIPPED", "run on one-GPU nodes only; NCCL checked instead")
        )
    rows.append(
        Row(
            "a dead or failing peer under NCCL",
            "SKIPPED",
            "not provoked: the survivors block until the process-group timeout"
            " (README, 'DDP: streams, failures, memory')",
        )
    )
    rows.append(Row("DDP across nodes", "SKIPPED", "one node only"))
    return rows


# ----------------------------------------------------------------------------------- the command


def print_table(rows: list[Row], file: Any = None) -> None:
    width = max(len(r.check) for r in rows)
    print(f"{'check':<{width}} | result  | figures", file=file)
    print(f"{'-' * width}-+---------+--------", file=file)
    for row in rows:
        print(f"{row.check:<{width}} | {row.status:<7} | {row.figure}", file=file)


def run(device: str, quick: bool, world: int) -> list[Row]:
    """Every check ``world`` devices of type ``device`` allow, then a row for each one they do not."""
    rows = check_one_process(device)
    rows += check_step_time(device, quick)
    if world >= 2:
        rows += check_ddp(device, world, quick)
        rows += check_lightning_ddp(device, world, quick)
        rows += check_fsdp(device, world, quick)
        rows += check_fsdp(device, world, quick, version=1)
        rows += check_lightning_deepspeed(device, world, quick) if deepspeed_installed() else []
    elif device == "cuda":
        rows += check_ddp(device, 2, quick, one_device=True)
    return rows + skipped_rows(device, world)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small models and few steps")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing to check.")
        return 0
    started = time.perf_counter()
    print(
        f"gpu_check: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}",
        flush=True,
    )
    rows = run("cuda", args.quick, torch.cuda.device_count())
    print_table(rows)
    print(f"gpu_check: {time.perf_counter() - started:.0f} s")
    return exit_code(rows)


def exit_code(rows: list[Row]) -> int:
    """1 for a correctness failure only: a goal MISSED or a check SKIPPED is reported, not failed."""
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

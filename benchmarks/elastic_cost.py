"""What following the batch with the devices saves: wall time and device-hours of fixed worlds against an elastic one.

    python benchmarks/elastic_cost.py                              # the BERT-Large shape, on its assumed device
    python benchmarks/elastic_cost.py --trace outputs/digits/TIME  # a recipe's trace, on the digits CPU device
    python benchmarks/elastic_cost.py --trace DIR --profile        # ... t(m) measured here for the digits CNN
    python benchmarks/elastic_cost.py --smoke                      # the BERT shape at 1% of its samples

Each takes a second or two after the imports (~10 s on 2 CPU cores); ``--profile`` adds a few seconds.

A model, not a measurement of a cluster. SimiGrad's batch grows 10-100x over a run; on a fixed world of W devices
that growth only lengthens each step (more micro-batches a rank), so the devices pay for the adaptive batch only
when their number follows it. This script replays a batch trajectory, step by step, on

- every fixed world of W = 1, 2, 4, ... devices up to the largest world an elastic plan uses (and that one);
- the elastic plan: before each step the wanted world follows the step's batch through
  :class:`~lightning_simigrad.core.world.WorldWanted` (the rule :class:`~lightning_simigrad.core.world.WorldRule`,
  with hysteresis), and :class:`~lightning_simigrad.core.world.ResizeTrigger` says when the current world moves to
  the wanted one, at the cost of a restart;
- the same rule followed exactly: resized at every change of the rule's answer (``resize_factor`` 1, no
  hysteresis) and for free (restart 0), without the trigger's lag or the restarts' cost.

The step-time model: a step of batch B in micro-batches of at most m on W ranks takes ``a = ceil(ceil(B/m)/W)``
micro-batches a rank, each of ``B / (W a)`` samples (or tokens), then one ring all-reduce of the gradient:

    step(B, W) = a * t(B / (W a)) + allreduce(W)
    t(x) = overhead + x / throughput              (or interpolated in a measured profile of (size, seconds) pairs)
    allreduce(W) = 2 (W - 1) / W * bytes / bandwidth + latency     (0 at W = 1)

A resize costs ``restart`` seconds of wall time (relaunch, checkpoint load), paid by every device of the new world;
the first launch is not counted (every plan pays it). Wall time is the sum of the steps and restarts; device-hours
are each step's (and restart's) seconds times its world. It prints the model's assumptions, then a table: each
plan's worlds, wall hours, device-hours, both as ratios to the best fixed world for each, and its restarts.

Trajectories:

- ``--trace PATH``: a recipe's ``simigrad_trace.csv`` (or its run directory, or a W&B export), read by
  :func:`lightning_simigrad.core.replay.read_trace`; batches in samples, or tokens where the trace counts them.
- the default, a BERT-Large-shaped trajectory built here: **an assumed shape, not data.** SimiGrad's paper (Qin et
  al., NeurIPS 2021) reports BERT-Large pretraining whose batch grows from B0 = 128 to ~78k sequences of 128
  tokens; its trajectory over the run is not published in this repository, so the shape is parametric: the batch
  grows geometrically in samples trained, from 128 to 78,000, over the first 10% of the samples, then holds; the
  samples are NVIDIA's LAMB phase-1 budget (7,038 steps of 65,536 sequences: 461M), not the paper's.

Devices (each value a command-line option; ``--device`` picks the set of defaults, by default the trajectory's):

- ``bert-large`` (assumed, not measured): 340M parameters, fp32 gradients of 1.36 GB; micro-batches of at most 64
  sequences (the ``bert_large_pretrain`` recipe's ``max_micro_batch_size``); 400 sequences/s a device and 20 ms a
  micro-batch, of the order of a data-centre GPU in mixed precision at 128 tokens; 12.5 GB/s a device for the
  all-reduce (100 Gb/s links), 1 ms a step; a restart of 120 s; 8 devices a node, at most 4 micro-batches a rank.
- ``digits-cpu``: the digits CNN (29.3k parameters, 117 kB of fp32 gradients) on one thread of an AMD EPYC,
  0.8 ms + x / 4,300 samples/s, a least-squares line through ``--profile`` on this project's 2-core machine (with
  another job on the other core); the network (10 GbE: 1.25 GB/s, 0.1 ms) and the restart (10 s) assumed; one
  device a node, one micro-batch a rank.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from lightning_simigrad.core.replay import Trajectory, read_trace
from lightning_simigrad.core.world import Elastic, ResizeTrigger, WorldRule, WorldWanted

HOUR = 3600.0
T = TypeVar("T", int, float)


# ---- trajectories
@dataclass(frozen=True)
class Course:
    """A batch trajectory to replay: each optimizer step's batch, in ``unit``; ``micro_batch`` is the most one device
    takes in one forward/backward, in the same unit; ``source`` says where the batches come from."""

    name: str
    unit: str
    sizes: tuple[int, ...]
    micro_batch: float
    source: str


def course_of_trace(path: str | Path, micro_batch: float | None = None) -> Course:
    """A recipe's trace (or a W&B export): its batches, and its largest micro-batch unless ``micro_batch`` is given.

    The trace logs micro-batches in samples; where its batches count tokens, a micro-batch of samples is taken at the
    step's tokens per sample (``batch_size / batch_samples``).
    """
    rows, lines = read_trace(path)
    trajectory = Trajectory.of_rows(rows, str(path), lines)
    if micro_batch is None:
        micro_batch = max((_micro_of(row, trajectory.unit) for row in rows), default=0.0)
        if not micro_batch > 0:
            raise ValueError(f"'{path}' logs no `micro_batch_size`: give --micro-batch (in {trajectory.unit}).")
    run = Path(path) if Path(path).is_dir() else Path(path).parent  # the run directory names the run
    return Course(run.name, trajectory.unit, trajectory.sizes, micro_batch, f"the trace {path}")


def _micro_of(row: dict[str, float], unit: str) -> float:
    micro = row.get("micro_batch_size", 0.0)
    if unit == "tokens":  # micro-batches are logged in samples: at the step's tokens a sample
        samples = row.get("batch_samples", 0.0)
        return micro * row["batch_size"] / samples if samples > 0 else 0.0
    return micro


def geometric_shape(b0: int, final: int, samples: int, ramp: float) -> tuple[int, ...]:
    """Batches that grow geometrically in samples trained, from ``b0`` to ``final`` over the first ``ramp`` of the
    ``samples``, then hold; the last step takes what is left.

    >>> geometric_shape(16, 256, 2000, 0.25)[:6]
    (16, 17, 19, 21, 24, 27)
    >>> sum(geometric_shape(16, 256, 2000, 0.25)), max(geometric_shape(16, 256, 2000, 0.25))
    (2000, 256)
    """
    if not (0 < b0 <= final and samples > 0 and 0 < ramp <= 1):
        raise ValueError(
            f"b0 = {b0}, final = {final}, samples = {samples}, ramp = {ramp}: 0 < b0 <= final, 0 < ramp <= 1."
        )
    sizes, seen, over = [], 0, ramp * samples
    while seen < samples:
        batch = round(b0 * (final / b0) ** min(1.0, seen / over))
        sizes.append(min(batch, samples - seen))
        seen += sizes[-1]
    return tuple(sizes)


BERT_B0, BERT_FINAL = 128, 78_000  # sequences: the paper's B0 and the batch it reports reaching
BERT_SAMPLES = 7_038 * 65_536  # NVIDIA's LAMB phase-1 budget, in sequences of 128 tokens
BERT_RAMP = 0.1  # the share of the samples over which the batch grows: an assumption
BERT_MICRO = 64  # sequences a device: the bert_large_pretrain recipe's max_micro_batch_size


def bert_large_course(samples: int | None = None, ramp: float | None = None, micro: float | None = None) -> Course:
    """The BERT-Large-shaped trajectory (an assumption, see the module's docstring)."""
    samples = BERT_SAMPLES if samples is None else samples
    ramp = BERT_RAMP if ramp is None else ramp
    share = "" if samples == BERT_SAMPLES else f"{samples / BERT_SAMPLES:.3g} x "
    source = (
        "an assumed shape, not data: SimiGrad's BERT-Large (Qin et al. 2021) grows its batch from 128 to ~78k"
        f" sequences; here geometrically in samples from {BERT_B0} to {BERT_FINAL:,} over the first {ramp:.0%} of"
        f" {samples:,} sequences ({share}NVIDIA's LAMB phase-1 budget, 7,038 x 65,536), then held"
    )
    sizes = geometric_shape(BERT_B0, BERT_FINAL, samples, ramp)
    return Course("BERT-Large shape", "samples", sizes, micro or BERT_MICRO, source)


# ---- the device model
@dataclass(frozen=True)
class Device:
    """The cost of one device's work: ``t(x)`` of a micro-batch of ``x`` samples (or tokens), a step's all-reduce,
    a restart. ``profile`` (size, seconds) pairs, when given, replace ``overhead + x / throughput``."""

    overhead_s: float
    throughput: float
    grad_bytes: float
    bandwidth: float
    latency_s: float
    restart_s: float
    profile: tuple[tuple[float, float], ...] = ()
    source: str = ""

    def micro_seconds(self, size: float) -> float:
        if self.profile:
            return _interpolate(self.profile, size)
        return self.overhead_s + size / self.throughput

    def allreduce_seconds(self, world: int) -> float:
        """Ring all-reduce: every rank sends and receives 2 (W - 1) / W of the gradient; nothing at W = 1."""
        if world == 1:
            return 0.0
        return 2 * (world - 1) / world * self.grad_bytes / self.bandwidth + self.latency_s


def _interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by size), extended past either end along the end segment, never
    below the fastest point measured (a smaller micro-batch is not cheaper than its overhead)."""
    if len(points) == 1:
        return points[0][1]
    i = next((k for k in range(1, len(points) - 1) if x < points[k][0]), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(min(y for _, y in points), y0 + (y1 - y0) * (x - x0) / (x1 - x0))


DEVICES = {
    "bert-large": Device(
        overhead_s=0.020, throughput=400.0, grad_bytes=340e6 * 4, bandwidth=12.5e9, latency_s=1e-3, restart_s=120.0,
        source="assumed, not measured: BERT-Large (340M parameters, fp32 gradients) on a data-centre GPU",
    ),
    # overhead and throughput: a least-squares line through `--profile` on one thread of this project's 2-core AMD
    # EPYC (another job on the other core); the network and the restart assumed
    "digits-cpu": Device(
        overhead_s=0.8e-3, throughput=4_300.0, grad_bytes=29_322 * 4, bandwidth=1.25e9, latency_s=1e-4, restart_s=10.0,
        source="the digits CNN on one CPU thread (t(m) fitted to --profile); network and restart assumed",
    ),
}  # fmt: skip
WORLDS = {  # the WorldRule's defaults that go with each device
    "bert-large": {"max_accumulation": 4, "devices_per_node": 8},
    "digits-cpu": {"max_accumulation": 1, "devices_per_node": 1},
}


def measure_profile(
    sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128), repeats: int = 15
) -> tuple[tuple[tuple[float, float], ...], int]:
    """The median seconds of one forward and backward of the digits recipe's CNN on random 8x8 images, at each size,
    on one thread; and its gradient's bytes (fp32)."""
    import torch
    from torch import nn

    from lightning_simigrad_recipes.models.nets import digits_cnn

    torch.set_num_threads(1)  # one device, one core: what a rank of a CPU world would have
    net = digits_cnn(num_classes=10, width=32)
    points = []
    for size in sizes:
        x, y = torch.randn(size, 1, 8, 8), torch.randint(0, 10, (size,))
        times = []
        for i in range(repeats + 3):  # the first three warm the allocator up
            start = time.perf_counter()
            nn.functional.cross_entropy(net(x), y).backward()
            net.zero_grad(set_to_none=True)
            if i >= 3:
                times.append(time.perf_counter() - start)
        points.append((float(size), statistics.median(times)))
    return tuple(points), sum(p.numel() for p in net.parameters()) * 4


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``overhead, throughput`` of the least-squares line ``seconds = overhead + size / throughput``."""
    slope, intercept = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return intercept, (1 / slope if slope > 0 else math.inf)


def read_profile(path: str | Path) -> tuple[tuple[float, float], ...]:
    """(size, seconds) pairs from a two-column CSV (a header line is skipped), sorted by size."""
    points = []
    with Path(path).open(newline="") as file:
        for row in csv.reader(file):
            try:
                points.append((float(row[0]), float(row[1])))
            except (ValueError, IndexError):
                continue  # the header, a blank line
    if not points:
        raise ValueError(f"'{path}' holds no (size, seconds) rows: write a CSV of two columns, size and seconds.")
    return tuple(sorted(points))


def write_profile(points: Sequence[tuple[float, float]], path: str | Path) -> None:
    with Path(path).open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["size", "seconds"])
        writer.writerows(points)


# ---- plans
@dataclass
class Plan:
    """A world plan replayed: per step its world and accumulation; the totals."""

    name: str
    worlds: list[int]
    accumulations: list[int]
    wall_s: float = 0.0
    device_s: float = 0.0
    restarts: int = 0

    @property
    def wall_h(self) -> float:
        return self.wall_s / HOUR

    @property
    def device_h(self) -> float:
        return self.device_s / HOUR

    def run(self, batch: int, micro_batch: float, world: int, device: Device) -> None:
        """One step on ``world`` devices."""
        accumulation, seconds = step_cost(batch, micro_batch, world, device)
        self.worlds.append(world)
        self.accumulations.append(accumulation)
        self.wall_s += seconds
        self.device_s += seconds * world


def step_cost(batch: int, micro_batch: float, world: int, device: Device) -> tuple[int, float]:
    """The micro-batches a rank takes and the step's seconds: the batch split evenly over ``world x accumulation``
    micro-batches (so a small batch on a large world runs small micro-batches, mostly overhead), then the all-reduce."""
    accumulation = math.ceil(math.ceil(batch / micro_batch) / world)
    compute = accumulation * device.micro_seconds(batch / (world * accumulation))
    return accumulation, compute + device.allreduce_seconds(world)


def fixed_plan(course: Course, world: int, device: Device) -> Plan:
    plan = Plan(f"fixed W={world}", [], [])
    for batch in course.sizes:
        plan.run(batch, course.micro_batch, world, device)
    return plan


def elastic_plan(
    course: Course, rule: WorldRule, device: Device, trigger: ResizeTrigger, shrink_at: float, name: str = "elastic"
) -> Plan:
    """The world follows the batch: the first step's world is the rule's; before each step the wanted nodes follow
    the step's batch (the controller plans it at the end of the step before), and a resize the trigger asks for
    moves the world there, every device of the new world paying the restart."""
    nodes = rule.nodes(course.sizes[0], course.micro_batch)
    wanted = WorldWanted(rule, nodes=nodes, shrink_at=shrink_at)
    plan = Plan(name, [], [])
    for batch in course.sizes:
        target = wanted.update(batch, course.micro_batch)
        if trigger.update(target, nodes):
            nodes = target
            plan.restarts += 1
            plan.wall_s += device.restart_s
            plan.device_s += device.restart_s * nodes * rule.devices_per_node
        plan.run(batch, course.micro_batch, nodes * rule.devices_per_node, device)
    return plan


def fixed_worlds(largest: int) -> list[int]:
    """1, 2, 4, ... up to ``largest``, and ``largest`` itself."""
    worlds = [2**k for k in range(largest.bit_length()) if 2**k <= largest]
    return worlds if worlds[-1] == largest else [*worlds, largest]


def compare(
    course: Course, rule: WorldRule, device: Device, trigger: ResizeTrigger, shrink_at: float
) -> tuple[list[Plan], list[Plan]]:
    """The fixed plans and the elastic ones (the trigger's, and the rule followed exactly, for free)."""
    name = f"elastic (x{trigger.resize_factor:g}, {trigger.patience})"  # the trigger's factor and patience
    elastic = elastic_plan(course, rule, device, trigger, shrink_at, name)
    bound = elastic_plan(
        course, rule, replace(device, restart_s=0.0), ResizeTrigger(1.0, 1), 1.0, "elastic, every step, free"
    )
    largest = max(max(elastic.worlds), max(bound.worlds))
    return [fixed_plan(course, world, device) for world in fixed_worlds(largest)], [elastic, bound]


# ---- output
def assumptions(course: Course, rule: WorldRule, device: Device, trigger: ResizeTrigger, shrink_at: float) -> list[str]:
    sizes, unit = course.sizes, course.unit
    if device.profile:
        timing = f"t(x) interpolated in a profile of {len(device.profile)} (size, seconds) points: " + ", ".join(
            f"{x:g}: {y * 1e3:.3g} ms" for x, y in device.profile
        )
    else:
        timing = f"t(x) = {device.overhead_s * 1e3:g} ms + x / {device.throughput:,.0f} {unit}/s"
    return [
        f"trajectory: {course.name}, {len(sizes):,} steps, batch {min(sizes):,}..{max(sizes):,} {unit}, "
        f"{sum(sizes):,} {unit} trained; {course.source}",
        f"micro-batch: at most {course.micro_batch:g} {unit} a device; a step's batch split evenly over its "
        "world x accumulation micro-batches",
        f"device: {device.source}; {timing}",
        f"all-reduce: 2 (W-1)/W x {device.grad_bytes / 1e9:.4g} GB / {device.bandwidth / 1e9:g} GB/s + "
        f"{device.latency_s * 1e3:g} ms a step (W > 1), not overlapped with the backward, one bandwidth in and "
        "across nodes",
        f"restart: {device.restart_s:g} s of wall time, paid by every device of the new world; the first launch "
        "not counted",
        f"world rule: WorldRule(max_accumulation={rule.max_accumulation}, devices_per_node={rule.devices_per_node},"
        f" min_nodes={rule.min_nodes}, max_nodes={rule.max_nodes}, min_samples_per_rank={rule.min_samples_per_rank:g}),"
        f" WorldWanted(shrink_at={shrink_at:g}), ResizeTrigger(resize_factor={trigger.resize_factor:g},"
        f" patience={trigger.patience})",
        "left out: data loading, the optimizer step, SimiGrad's own exchange (for W >= 4 an all-to-all of up to"
        " half the gradient within half the ranks), waiting for nodes; a fixed world larger than a batch runs"
        " fractions of a sample a rank",
    ]


def table(fixed: Sequence[Plan], elastic: Sequence[Plan]) -> list[str]:
    best_wall = min(fixed, key=lambda p: p.wall_s)
    best_devices = min(fixed, key=lambda p: p.device_s)
    lines = [
        f"{'plan':<26} {'worlds':>9} {'wall h':>10} {'device-h':>10} {'wall/best':>10} {'dev-h/best':>10} "
        f"{'restarts':>8}"
    ]
    for plan in [*fixed, *elastic]:
        low, high = min(plan.worlds), max(plan.worlds)
        worlds = str(low) if low == high else f"{low}..{high}"
        lines.append(
            f"{plan.name:<26} {worlds:>9} {plan.wall_h:>10.4g} {plan.device_h:>10.4g} "
            f"{plan.wall_s / best_wall.wall_s:>10.3f} {plan.device_s / best_devices.device_s:>10.3f} {plan.restarts:>8}"
        )
    lines.append(f"best fixed world: for wall time {best_wall.name}, for device-hours {best_devices.name}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=None, help="a recipe's simigrad_trace.csv or run directory (default: the shape)")
    p.add_argument("--micro-batch", type=float, default=None, help="most a device takes at once (default: see above)")
    p.add_argument("--samples", type=int, default=None, help=f"the shape's samples (default {BERT_SAMPLES:,})")
    p.add_argument("--ramp", type=float, default=None, help="the shape's share of samples spent growing (default 0.1)")
    p.add_argument("--smoke", action="store_true", help="the shape at 1%% of its samples (a trace: as it is)")
    p.add_argument("--device", choices=sorted(DEVICES), default=None, help="the defaults (default: see above)")
    # each default: bert-large's, digits-cpu's
    p.add_argument("--overhead", type=float, default=None, help="s a micro-batch adds (0.02, 8e-4)")
    p.add_argument("--throughput", type=float, default=None, help="samples (tokens) a second a device (400, 4300)")
    p.add_argument("--grad-bytes", type=float, default=None, help="bytes all-reduced (1.36e9, 117288)")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s a device sends (12.5e9, 1.25e9)")
    p.add_argument("--latency", type=float, default=None, help="s an all-reduce adds (1e-3, 1e-4)")
    p.add_argument("--restart", type=float, default=None, help="s a resize costs (120, 10)")
    p.add_argument("--max-accumulation", type=int, default=None, help="micro-batches a rank (4, 1)")
    p.add_argument("--devices-per-node", type=int, default=None, help="(8, 1)")
    p.add_argument("--min-nodes", type=int, default=1, help="(default 1)")
    p.add_argument("--max-nodes", type=int, default=None, help="(default: unbounded)")
    p.add_argument("--min-samples-per-rank", type=float, default=2.0, help="(default 2)")
    p.add_argument("--shrink-at", type=float, default=Elastic.shrink_at, help="WorldWanted's hysteresis (Elastic's)")
    p.add_argument(
        "--resize-factor", type=float, default=Elastic.resize_factor, help="ResizeTrigger's ratio (Elastic's)"
    )
    p.add_argument("--patience", type=int, default=Elastic.patience, help="ResizeTrigger's steps in a row (Elastic's)")
    p.add_argument("--profile-file", default=None, help="a CSV of (size, seconds): t(x) interpolated in it")
    p.add_argument("--profile", action="store_true", help="measure t(x) of the digits CNN on this CPU (one thread)")
    p.add_argument("--save-profile", default=None, help="with --profile: write the points measured to this CSV")
    args = p.parse_args(argv)

    if args.trace:
        course = course_of_trace(args.trace, args.micro_batch)
    else:
        samples = args.samples or (BERT_SAMPLES // 100 if args.smoke else None)
        course = bert_large_course(samples, args.ramp, args.micro_batch)
    preset = args.device or ("digits-cpu" if args.trace else "bert-large")
    device = device_of(args, DEVICES[preset])
    rule = WorldRule(
        max_accumulation=_given(args.max_accumulation, WORLDS[preset]["max_accumulation"]),
        devices_per_node=_given(args.devices_per_node, WORLDS[preset]["devices_per_node"]),
        min_nodes=args.min_nodes, max_nodes=args.max_nodes, min_samples_per_rank=args.min_samples_per_rank,
    )  # fmt: skip
    trigger = ResizeTrigger(resize_factor=args.resize_factor, patience=args.patience)
    fixed, elastic = compare(course, rule, device, trigger, args.shrink_at)
    print("A model, not a measurement of a cluster. Assumptions:")
    print("\n".join(f"- {line}" for line in assumptions(course, rule, device, trigger, args.shrink_at)))
    print()
    print("\n".join(table(fixed, elastic)))
    return 0


def _given(value: T | None, default: T) -> T:
    return default if value is None else value


def device_of(args: argparse.Namespace, preset: Device) -> Device:
    """The preset with the options given, and a profile (read, or measured here) where asked for."""
    device = replace(
        preset,
        overhead_s=_given(args.overhead, preset.overhead_s),
        throughput=_given(args.throughput, preset.throughput),
        grad_bytes=_given(args.grad_bytes, preset.grad_bytes),
        bandwidth=_given(args.bandwidth, preset.bandwidth),
        latency_s=_given(args.latency, preset.latency_s),
        restart_s=_given(args.restart, preset.restart_s),
    )
    if args.profile:
        points, grad_bytes = measure_profile()
        if args.save_profile:
            write_profile(points, args.save_profile)
        overhead, throughput = fit_line(points)
        print(f"profile measured here: {overhead * 1e3:.3g} ms + x / {throughput:,.0f} a second (least squares)")
        return replace(device, profile=points, grad_bytes=_given(args.grad_bytes, grad_bytes),
                       source="the digits CNN measured here, one thread (--profile)")  # fmt: skip
    if args.profile_file:
        return replace(device, profile=read_profile(args.profile_file), source=f"the profile {args.profile_file}")
    return device


if __name__ == "__main__":
    sys.exit(main())

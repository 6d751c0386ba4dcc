"""``simigrad-trace``: read a finished run's trace, summarise and plot it, and write its replayable schedule.

    simigrad-trace outputs/digits/2025-01-01_12-00-00/simigrad_trace.csv      # the summary
    simigrad-trace TRACE.csv --plot trace.png                                   # batch, similarity, noise scale
    simigrad-trace TRACE.csv --schedule schedule.yaml --smooth 5 --snap doubling
    simigrad-train simigrad=replay simigrad.trace=schedule.yaml                 # train on it, no controller

A trace is a recipe's ``simigrad_trace.csv`` (or the run directory holding it) or a W&B export of the run's
``simigrad/*`` metrics. Batch sizes count what the run counted: tokens where the trace has ``tokens_seen``, else
samples. The schedule is ``{samples (tokens) trained before a step: its global batch size}``, in YAML for
``simigrad=replay`` and ``BatchSizeSchedule.from_trace``, or as a Python dict literal (``.py``). A path that is
not a file, or a file that is not a trace, is one ``error:`` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from pathlib import Path

from lightning_simigrad.core.replay import SNAPS, Trajectory, read_trace, replay_steps

_SUFFIXES = (".yaml", ".yml", ".py")


def summary(path: str, rows: list[dict[str, float]], trajectory: Trajectory) -> list[str]:
    """The lines ``simigrad-trace`` prints: steps, unit, what was trained, the batch's range, B0, the median
    similarity and the last noise scale."""
    unit, sizes = trajectory.unit, trajectory.sizes
    trained = f"{trajectory.seen[-1]:,} {unit}"
    if unit == "tokens" and "samples_seen" in rows[-1]:
        trained += f" in {int(rows[-1]['samples_seen']):,} samples"
    similarities = [row["similarity"] for row in rows if math.isfinite(row.get("similarity", math.nan))]
    similarity = (
        f"median {statistics.median(similarities):.3f} over {len(similarities)} measured steps"
        if similarities
        else "not measured"
    )
    noise = "not measured"
    for key, counts in (("noise_scale", "samples"), ("noise_scale_tokens", "tokens")):
        last = next((row[key] for row in reversed(rows) if math.isfinite(row.get(key, math.nan))), None)
        if last is not None:
            noise = f"{last:,.4g} {counts}" if noise == "not measured" else f"{noise}, {last:,.4g} {counts}"
    return [
        f"{path}: {len(sizes)} steps, batch sizes in {unit}, {trained} trained",
        f"batch size {min(sizes):,}..{max(sizes):,} {unit}, B0 = {sizes[0]:,} (the first step's),"
        f" last step {sizes[-1]:,}",
        f"similarity: {similarity}",
        f"noise scale B_noise at the last measured step: {noise}",
    ]


def write_schedule(out: Path, steps: dict[int, int], trajectory: Trajectory, command: str) -> None:
    """``steps`` as a YAML ``simigrad=replay`` reads (``unit`` and ``schedule``) or a Python dict literal (``.py``)."""
    unit = trajectory.unit
    head = [
        f"# {command}",
        f"# A finished SimiGrad run's batch sizes, {len(trajectory.sizes)} steps in {unit}:",
        f"# {{{unit} trained before a step: its global batch size}}, each size held until the next key.",
    ]
    if out.suffix == ".py":
        head.append('# Replay it: BatchSizeSchedule(ast.literal_eval(Path("...").read_text()))')
        body = ["{", *(f"    {trained}: {size}," for trained, size in steps.items()), "}"]
    else:
        head.append(f"# Replay it: simigrad-train simigrad=replay simigrad.trace={out} (the run's experiment)")
        body = [
            f"unit: {unit}  # what the keys and the batch sizes count",
            "schedule:",
            *(f"  {trained}: {size}" for trained, size in steps.items()),
        ]
    out.write_text("\n".join(head + body) + "\n")


def plot(
    out: Path, rows: list[dict[str, float]], trajectory: Trajectory, steps: dict[int, int] | None, title: str
) -> None:
    """Batch size (and the replayed schedule, where it was smoothed or snapped), similarity and noise scale against
    what was trained."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = trajectory.unit
    x = list(trajectory.seen)

    def col(key: str) -> list[float]:
        return [row.get(key, math.nan) for row in rows]

    def held(starts: list[int], sizes: list[int]) -> tuple[list[int], list[int]]:
        """Each size from the weight trained before its step on, to the end of the trace."""
        return [*starts, x[-1]], [*sizes, sizes[-1]]

    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    before = [seen - size for seen, size in zip(x, trajectory.sizes)]
    axes[0].step(*held(before, list(trajectory.sizes)), where="post", label="batch size B")
    if steps is not None:
        axes[0].step(*held(list(steps), list(steps.values())), where="post", label="replayed schedule")
    axes[0].set_yscale("log")
    axes[0].set_ylabel(unit)
    axes[0].legend(loc="best", fontsize=8)
    axes[1].plot(x, col("similarity"), ".", markersize=3)
    axes[1].set_ylabel("similarity")
    noise = "noise_scale_tokens" if unit == "tokens" and "noise_scale_tokens" in rows[-1] else "noise_scale"
    axes[2].plot(x, col(noise))
    if any(value > 0 for value in col(noise)):  # early estimates may be negative or NaN: log scale once there are any
        axes[2].set_yscale("log")
    axes[2].set_ylabel(f"noise scale ({'tokens' if noise.endswith('tokens') else 'samples'})")
    axes[2].set_xlabel(f"{unit} trained")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace, command: str) -> list[str]:
    """What ``simigrad-trace`` does with its parsed ``args``; returns the lines to print."""
    if args.schedule is not None and Path(args.schedule).suffix not in _SUFFIXES:
        raise ValueError(
            f"--schedule {args.schedule}: end the name in .yaml (read by simigrad=replay and"
            " BatchSizeSchedule.from_trace) or .py (a Python dict literal)"
        )
    if Path(args.trace).suffix in _SUFFIXES:
        raise ValueError(
            f"'{args.trace}' is a schedule, not a trace: pass the simigrad_trace.csv (or W&B export) it came from"
        )
    rows, lines = read_trace(args.trace)
    trajectory = Trajectory.of_rows(rows, f"'{args.trace}'", lines)
    steps = replay_steps(
        trajectory.seen, trajectory.sizes, args.smooth, args.snap, args.initial_batch_size, trajectory.unit, lines
    )
    shaped = ", ".join(f"{k} {v}" for k, v in (("smooth", args.smooth), ("snap", args.snap)) if v is not None)
    out = summary(args.trace, rows, trajectory)
    low, high = min(steps.values()), max(steps.values())
    count = f"{len(steps)} size{'s' if len(steps) > 1 else ''}"
    out.append(f"schedule{f' ({shaped})' if shaped else ''}: {count}, {low:,}..{high:,} {trajectory.unit}")
    if args.plot is not None:
        plot(Path(args.plot), rows, trajectory, steps if shaped else None, str(args.trace))
        out.append(f"plot: {args.plot}")
    if args.schedule is not None:
        write_schedule(Path(args.schedule), steps, trajectory, command)
        out.append(f"schedule: {args.schedule}")
    return out


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(
        prog="simigrad-trace",
        description="Summarise a SimiGrad run's trace, plot it, and write its batch sizes as a replayable schedule.",
        epilog="Replay a schedule: simigrad-train simigrad=replay simigrad.trace=schedule.yaml",
    )
    made.add_argument("trace", help="a recipe's simigrad_trace.csv (or its run directory), or a W&B export")
    made.add_argument("--plot", metavar="OUT.png", help="batch size, similarity and noise scale against samples")
    made.add_argument("--schedule", metavar="OUT.yaml|OUT.py", help="write the schedule {trained: batch size}")
    made.add_argument("--smooth", type=int, metavar="N", help="each step's batch: the median of N steps (N odd)")
    made.add_argument("--snap", choices=SNAPS, help="doubling: batch sizes B0 x 2^k, never below B0")
    made.add_argument(
        "--initial-batch-size", type=int, metavar="B0", help="the first level of --snap (default: the first step's)"
    )
    return made


def main(argv: list[str] | None = None) -> None:
    """Console entry ``simigrad-trace``: a user error is one ``error:`` line on stderr and exit code 2."""
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    try:
        lines = run(args, shlex.join(["simigrad-trace", *argv]))
    except (OSError, ValueError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        sys.exit(2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Why the digits recipe's logged noise scale and its per-step similarity disagreed, measured.

(Written before the finite-population estimators; ``benchmarks/noise_scale_reference.py`` now compares the
logged values with the exact ones. The raw-value EMA and ``trace`` printed here are the with-replacement forms.)

    python benchmarks/noise_scale_diagnosis.py                 # ~3 minutes on 2 CPU cores
    python benchmarks/noise_scale_diagnosis.py --draws 200 simigrad.max_batch_size=256

Trains the digits recipe (any Hydra overrides after the options) while recording every step's raw
half-batch statistics, then separates three explanations of a gap between the smoothed noise scale
``B_noise = EMA(tr Sigma) / EMA(|G|^2)`` and the noise scale the raw similarity implies,
``B (1 - cos) / (2 cos)``:

1. **Memory of past magnitudes** (non-stationarity): |G|^2 and tr(Sigma) fall by orders of magnitude
   while the model trains, so an EMA of each is dominated by steps long gone. Printed: the share of the
   EMA's |G|^2 that comes from steps more than 20 steps back, and the raw-value EMA (the estimator
   before the fix) beside the logged one (each step's numerator and denominator in units of that step's
   mean |g_half|^2).
2. **Finite population**: two halves drawn without replacement from N images have negatively correlated
   noise, E[g_A . g_B] = |G|^2 - tr(Sigma) / (N - 1). Printed: with the trained weights frozen, the mean
   statistics over ``--draws`` random windows drawn without replacement (as the sampler draws) and with
   replacement (independent halves), micro-batches and BatchNorm as in training.
3. **An estimator defect**: the frozen-weight draws with replacement must give the noise scale whatever
   the window size; a defect would show as a dependence on B.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_simigrad import HalfStats

# the recipes are imported in main() only: the one place this script depends on them


def record_raw_stats(trainer: Any, callback: Any) -> list[dict[str, float]]:
    """Wrap the run's ``controller.update`` when training starts so every step's raw statistics are kept."""
    import lightning.pytorch as pl

    rows: list[dict[str, float]] = []

    class RawStats(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            controller = callback.run.controller
            update = controller.update

            def recording_update(stats: HalfStats, adjust: bool = True, population: float = math.inf) -> int:
                out = update(stats, adjust, population)
                rows.append(
                    dict(
                        batch=stats.batch_size,
                        dot=stats.dot,
                        sq_a=stats.sq_a,
                        sq_b=stats.sq_b,
                        n_a=stats.n_a,
                        n_b=stats.n_b,
                        trace=stats.trace_sigma,
                        similarity=stats.similarity,
                        logged_noise_scale=controller.noise_scale,
                    )
                )
                return out

            controller.update = recording_update

    trainer.callbacks.append(RawStats())
    return rows


def ema_share_older_than(values: list[float], decay: float, lag: int) -> float:
    """Share of the bias-corrected EMA of ``values`` (at the last step) carried by steps older than ``lag``."""
    weights = [(1 - decay) * decay ** (len(values) - 1 - i) for i in range(len(values))]
    total = sum(w * v for w, v in zip(weights, values))
    old = sum(w * v for w, v in zip(weights[: max(0, len(values) - lag)], values))
    return old / total if total else math.nan


def ema_mean_age(values: list[float], decay: float) -> float:
    """Mean age in steps of what the EMA of ``values`` holds at the last step, each step weighed by its share."""
    weights = [(1 - decay) * decay ** (len(values) - 1 - i) * v for i, v in enumerate(values)]
    return sum((len(values) - 1 - i) * w for i, w in enumerate(weights)) / sum(weights)


def raw_ema_noise_scale(rows: list[dict[str, float]], decay: float) -> list[float]:
    """EMA(tr Sigma) / EMA(|G|^2) of the raw values: the library's estimator before it smoothed relative ones."""
    num = den = 0.0
    out = []
    for r in rows:
        num = decay * num + (1 - decay) * r["trace"]
        den = decay * den + (1 - decay) * r["dot"]
        out.append(num / den if den > 0 else math.nan)
    return out


def implied_noise_scale(batch: float, similarity: float) -> float:
    """Invert E[cos] = 1 / (1 + 2 B_noise / B) for equal halves."""
    return batch * (1 - similarity) / (2 * similarity) if similarity > 0 else math.inf


@torch.enable_grad()
def half_statistics(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, micro: int
) -> tuple[float, float, float]:
    """|g_A|^2, |g_B|^2, g_A . g_B of the two halves of window ``idx``, micro-batches of ``micro``."""
    params = [p for p in net.parameters() if p.requires_grad]
    halves = []
    for part in idx.chunk(2):
        for p in params:
            p.grad = None
        for chunk in part.split(micro):
            loss = nn.functional.cross_entropy(net(x[chunk]), y[chunk]) * (len(chunk) / len(part))
            loss.backward()
        halves.append(torch.cat([p.grad.flatten() for p in params]).double())
    a, b = halves
    return float(a @ a), float(b @ b), float(a @ b)


def frozen_draws(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, micro: int, draws: int, replacement: bool, seed: int
) -> dict[str, float]:
    """Mean half-batch statistics over random windows of ``batch`` samples at fixed weights."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: v.clone() for k, v in net.state_dict().items()}  # BatchNorm running stats move in train mode
    net.train()
    dots, traces, cosines = [], [], []
    n = batch // 2
    for _ in range(draws):
        if replacement:
            idx = torch.randint(len(x), (batch,), generator=gen)
        else:
            idx = torch.randperm(len(x), generator=gen)[:batch]
        sq_a, sq_b, dot = half_statistics(net, x, y, idx, micro)
        s = HalfStats(dot=dot, sq_a=sq_a, sq_b=sq_b, n_a=n, n_b=n)
        dots.append(s.grad_sq)
        traces.append(s.trace_sigma)
        cosines.append(s.similarity)
    net.load_state_dict(state)
    grad_sq, trace = statistics.mean(dots), statistics.mean(traces)
    return {
        "grad_sq": grad_sq,
        "grad_sq_sem": statistics.stdev(dots) / math.sqrt(draws),
        "trace": trace,
        "noise_scale": trace / grad_sq if grad_sq > 0 else math.inf,
        "similarity": statistics.mean(cosines),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=60, help="random windows per frozen-weight measurement")
    parser.add_argument("--sizes", default="128,512,1024", help="window sizes for the frozen-weight draws")
    parser.add_argument("--out", default="outputs/noise_scale_diagnosis", help="run directory")
    args, overrides = parser.parse_known_args(argv)

    from hydra import compose, initialize_config_module

    from lightning_simigrad_recipes.train import CONFIG_MODULE, train

    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=["logger=none", "trainer.enable_progress_bar=false", f"output_dir={args.out}", *overrides],
        )
    if cfg.name != "digits":
        sys.exit("the frozen-weight draws are written for the digits classifier; keep experiment=digits")

    # keep the module and the callback that train() builds, to read them afterwards
    captured: dict[str, Any] = {}
    import lightning.pytorch as pl

    from lightning_simigrad import SimiGrad

    original_fit = pl.Trainer.fit

    def fit(self: pl.Trainer, model: pl.LightningModule, *a: Any, **k: Any) -> Any:
        captured["module"], captured["datamodule"] = model, k.get("datamodule")
        callback = next(cb for cb in self.callbacks if isinstance(cb, SimiGrad))
        captured["rows"] = record_raw_stats(self, callback)
        return original_fit(self, model, *a, **k)

    pl.Trainer.fit = fit  # type: ignore[method-assign]
    start = time.perf_counter()
    train(cfg)
    pl.Trainer.fit = original_fit  # type: ignore[method-assign]
    rows: list[dict[str, float]] = captured["rows"]
    decay = float(cfg.simigrad.noise_scale_decay) if "noise_scale_decay" in cfg.simigrad else 0.9
    print(f"\ntrained {len(rows)} measured steps in {time.perf_counter() - start:.0f} s")

    # ---- 1. the trace: raw similarity against the smoothed noise scale
    top = max(r["batch"] for r in rows)
    late = [r for r in rows[len(rows) // 2 :] if r["batch"] == top]
    raw = raw_ema_noise_scale(rows, decay)
    late_raw = [f for r, f in zip(rows[len(rows) // 2 :], raw[len(rows) // 2 :]) if r["batch"] == top]
    mean_cos = statistics.mean(r["similarity"] for r in late)
    print(f"\n1. second half of training, the {len(late)} steps at B = {top}:")
    print(f"   similarity: mean {mean_cos:.3f}, median {statistics.median(r['similarity'] for r in late):.3f}")
    print(f"   noise scale the mean similarity implies, B(1-cos)/(2cos): {implied_noise_scale(top, mean_cos):.0f}")
    print(f"   EMA of the raw |G|^2 and tr(Sigma) (the former estimator): median {statistics.median(late_raw):.0f}")
    print(
        f"   logged noise scale (EMA in units of each step's |g_half|^2): median "
        f"{statistics.median(r['logged_noise_scale'] for r in late):.0f}"
    )
    first = statistics.median(abs(r["dot"]) for r in rows[:10])
    last = statistics.median(abs(r["dot"]) for r in rows[-20:])
    print(f"   |G|^2 estimate, median of its size: first 10 steps {first:.3g}, last 20 steps {last:.3g}")
    tails = [r["dot"] for r in rows[len(rows) // 2 :] if r["batch"] != top]
    if tails:
        at_top, at_tails = statistics.mean(r["dot"] for r in late), statistics.mean(tails)
        print(f"   |G|^2 estimate, mean over the same half: at B = {top} {at_top:.3g}, epoch tails {at_tails:.3g}")
    share = ema_share_older_than([r["dot"] for r in rows], decay, lag=20)
    print(f"   share of the final EMA of |G|^2 from steps more than 20 steps old: {share:.3f}")
    age = ema_mean_age([r["dot"] for r in rows], decay)
    print(f"   mean age of the final EMA of |G|^2, weighed by content: {age:.0f} steps")

    # ---- 2 and 3. frozen weights: finite population and the estimator across window sizes
    module, datamodule = captured["module"], captured["datamodule"]
    x = torch.stack([datamodule.train_set[i][0] for i in range(len(datamodule.train_set))])
    y = torch.stack([datamodule.train_set[i][1] for i in range(len(datamodule.train_set))])
    micro = int(cfg.simigrad.max_micro_batch_size)
    print(f"\n2./3. trained weights frozen, N = {len(x)} training images, micro-batches of {micro}, {args.draws} draws")
    print("   window  drawn     mean cos  |G|^2 est (+-sem)      tr(Sigma) est  B_noise  predicted |G|^2 without")
    for size in (int(s) for s in args.sizes.split(",")):
        measured = {}
        for replacement in (False, True):
            m = measured[replacement] = frozen_draws(module.net, x, y, size, micro, args.draws, replacement, seed=size)
            predicted = ""
            if replacement:  # drawn without replacement, E[g_A . g_B] = |G|^2 - tr(Sigma) / (N - 1)
                predicted = f"{m['grad_sq'] - m['trace'] / (len(x) - 1):.3e}"
            print(
                f"   {size:6d}  {'with' if replacement else 'without':7s} {m['similarity']:8.3f}"
                f"  {m['grad_sq']:.3e} (+-{m['grad_sq_sem']:.1e})   {m['trace']:.3e}  {m['noise_scale']:7.0f}"
                f"  {predicted}"
            )
    print(f"\nrun directory: {Path(args.out).resolve()}; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

"""The exact noise scale and similarity at fixed weights, against what ``SimiGrad`` logs there.

    python benchmarks/noise_scale_reference.py           # the digits CNN, epochs 0,1,5,8: ~15 min on 2 cores
    python benchmarks/noise_scale_reference.py --epochs 5 --sizes 128 --steps 200

For a model at fixed weights ``w`` and a training set of N samples, the per-sample gradients ``g_i``
(``torch.func.functional_call`` + ``vmap(grad)``, float64) give the truth: their Gram matrix
``K = [g_i . g_j]`` gives ``|G|^2 = sum(K) / N^2``, ``tr(Sigma) = mean |g_i - G|^2 = trace(K) / N - |G|^2``,
the simple noise scale ``B_noise = tr(Sigma) / |G|^2``, and the expected similarity of two halves of B/2
samples drawn without replacement (as the sampler draws them), by Monte Carlo over ``--draws`` random
windows of the exact gradients (its standard error printed), beside the closed form of
``lightning_simigrad.expected_similarity``.

Then ``SimiGrad(adjust=False)`` runs ``--steps`` optimizer steps of B samples at those weights, frozen
(SGD at lr 0), and the table shows the mean logged ``simigrad/noise_scale`` and ``simigrad/similarity``
with standard errors (batch means over blocks of 25 steps: the logged noise scale is an EMA, so steps
are correlated), after the first 20 steps (the EMA's warm-up). Every step's raw half statistics are
recorded too, so that the table also shows what other smoothings would have logged from the same steps
(``--variants``): the library before the finite-population estimators (``before``: each step's estimates
for draws with replacement, in units of its own mean |g_half|^2), the finite-population estimates in
units of the step's own size (``own``), of the raw values (``raw``), and the library's (``ref``: in units
of the step before's size) with a longer memory (``ref.99``: decay 0.99).

The model is the digits recipe's CNN without its BatchNorm layers (BatchNorm makes a sample's gradient
depend on its micro-batch, so per-sample gradients are not defined), trained for the checkpoints'
epochs with SGD (lr 0.05, momentum 0.9, batches of 32, seed 0) on the recipe's 1,437 training images.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, Dataset

from lightning_simigrad import HalfStats, SimiGrad, expected_similarity

WARMUP, BLOCK = 20, 25


# ------------------------------------------------------------------------------------------------- the truth
def per_sample_gradients(net: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """N x P matrix of every sample's loss gradient (float64), for a net whose loss is the mean cross-entropy."""
    net64 = _double_copy(net)
    params = {k: v.detach() for k, v in net64.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(net64, p, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    rows = []
    for start in range(0, len(x), chunk):
        g = per_sample(params, x[start : start + chunk].double(), y[start : start + chunk])
        rows.append(torch.cat([g[k].flatten(1) for k in params], dim=1))
    return torch.cat(rows)


def _double_copy(net: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(net).double()


@dataclass
class Truth:
    """The exact statistics at fixed weights, from the per-sample gradients' Gram matrix."""

    gram: torch.Tensor
    n: int = field(init=False)
    grad_sq: float = field(init=False)
    trace_sigma: float = field(init=False)

    def __post_init__(self) -> None:
        self.n = len(self.gram)
        self.grad_sq = float(self.gram.sum()) / self.n**2
        self.trace_sigma = float(self.gram.diagonal().sum()) / self.n - self.grad_sq

    @property
    def noise_scale(self) -> float:
        return self.trace_sigma / self.grad_sq

    def similarity(self, batch: int, draws: int, seed: int = 0) -> tuple[float, float]:
        """Mean and standard error of cos(g_A, g_B) over ``draws`` windows of ``batch`` samples drawn without
        replacement, halves of ``batch // 2``: the exact expectation, to its Monte Carlo error."""
        gen = torch.Generator().manual_seed(seed)
        half = batch // 2
        cosines = []
        for _ in range(draws):
            idx = torch.randperm(self.n, generator=gen)[: 2 * half]
            a, b = idx[:half], idx[half:]
            dot = self.gram[a][:, b].sum()
            cosines.append(float(dot / (self.gram[a][:, a].sum() * self.gram[b][:, b].sum()).sqrt()))
        return statistics.mean(cosines), statistics.stdev(cosines) / math.sqrt(draws)


def exact(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Truth:
    g = per_sample_gradients(net, x, y)
    return Truth(g @ g.T)


# ------------------------------------------------------------------------------------------------- what is logged
class FrozenClassifier(pl.LightningModule):
    """``net`` under SGD at lr 0: every step measures the same weights."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Tensors(Dataset):
    """Samples of ``x`` and ``y`` fetched a micro-batch at a time (``__getitems__``): no per-sample collation."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[indices], self.y[indices]


def _as_batch(batch: Any) -> Any:
    return batch


class RawStats(pl.Callback):
    """Keeps every step's raw half statistics and the epoch's N, as the controller receives them."""

    def __init__(self, simigrad: SimiGrad) -> None:
        self.simigrad = simigrad
        self.rows: list[tuple[HalfStats, float]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        controller = self.simigrad.run.controller
        update = controller.update

        def recording_update(stats: HalfStats, adjust: bool = True, population: float = math.inf) -> int:
            self.rows.append((stats, population))
            return update(stats, adjust, population)

        controller.update = recording_update  # type: ignore[method-assign]


@dataclass
class Logged:
    noise_scale: list[float]
    similarity: list[float]
    raw: list[tuple[HalfStats, float]]


def logged_at_frozen_weights(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, steps: int, seed: int = 0, **simigrad: Any
) -> Logged:
    """Run ``SimiGrad(adjust=False)`` for ``steps`` optimizer steps of ``batch`` samples (halves of ``batch // 2``,
    the tail of each epoch dropped) with the weights frozen; returns what it logged every step."""
    pl.seed_everything(seed, verbose=False)
    cb = SimiGrad(target_similarity=0.5, adjust=False, schedule_by_samples=False, **simigrad)
    raw = RawStats(cb)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[cb, raw],
    )
    loader = DataLoader(Tensors(x, y), batch_size=batch, shuffle=True, drop_last=True, collate_fn=_as_batch)
    trainer.fit(FrozenClassifier(net), loader)
    return Logged([h["noise_scale"] for h in cb.history], [h["similarity"] for h in cb.history], raw.rows)


# ------------------------------------------------------------------------------------------------- smoothings
def smoothed(rows: Sequence[tuple[HalfStats, float]], decay: float, normalise: str, finite: bool = True) -> list[float]:
    """The noise scale a smoothing would have logged every step from the same raw statistics.

    ``normalise``: ``"ref"`` (each step's estimates in units of the step before's mean |g_half|^2: the library),
    ``"own"`` (in units of its own), ``"raw"`` (none). ``finite``: the finite-population estimates, or those for
    draws with replacement.
    """
    num = den = weight = 0.0
    previous = 0.0
    out = []
    for stats, population in rows:
        size = 0.5 * (stats.sq_a + stats.sq_b)
        unit = {"ref": previous if previous > 0 else size, "own": size, "raw": 1.0}[normalise]
        previous = size
        grad_sq, trace = stats.estimates(population if finite else math.inf)
        num = decay * num + (1 - decay) * trace / unit
        den = decay * den + (1 - decay) * grad_sq / unit
        weight = decay * weight + (1 - decay)
        out.append(num / den if den > 0 else math.nan)
    return out


VARIANTS: dict[str, Callable[[Sequence[tuple[HalfStats, float]]], list[float]]] = {
    "before": lambda rows: smoothed(rows, 0.9, "own", finite=False),
    "own": lambda rows: smoothed(rows, 0.9, "own"),
    "raw": lambda rows: smoothed(rows, 0.9, "raw"),
    "ref": lambda rows: smoothed(rows, 0.9, "ref"),
    "ref.99": lambda rows: smoothed(rows, 0.99, "ref"),
}


def mean_and_error(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean after the warm-up, its standard error by batch means over blocks of ``BLOCK`` steps, and the share of
    steps whose value is not finite (left out of the mean)."""
    values = list(values[WARMUP:])
    finite = [v for v in values if math.isfinite(v)]
    nan_share = 1 - len(finite) / len(values) if values else math.nan
    if len(finite) < 2:
        return math.nan, math.nan, nan_share
    blocks = [statistics.mean(finite[i : i + BLOCK]) for i in range(0, len(finite) - BLOCK + 1, BLOCK)]
    error = statistics.stdev(blocks) / math.sqrt(len(blocks)) if len(blocks) > 1 else math.nan
    return statistics.mean(finite), error, nan_share


# ------------------------------------------------------------------------------------------------- the recipe's model
def digits_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The digits recipe's 1,437 training images and labels (its split: 20% held out, stratified, seed 0)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, _ = train_test_split(range(len(labels)), test_size=0.2, stratify=labels, random_state=0)
    return images[train_idx], labels[train_idx]


def digits_cnn_without_batchnorm(width: int = 32) -> nn.Module:
    """The recipe's ``digits_cnn`` with its BatchNorm layers taken out."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 16, 10),
    )


def checkpoints(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: Sequence[int], lr: float = 0.05, seed: int = 0
) -> dict[int, dict[str, torch.Tensor]]:
    """The net's weights after each of ``epochs`` epochs of SGD (momentum 0.9, batches of 32)."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    saved = {}
    for epoch in range(max(epochs) + 1):
        if epoch in epochs:
            saved[epoch] = {k: v.clone() for k, v in net.state_dict().items()}
        for idx in torch.randperm(len(x), generator=gen).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    return saved


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", default="0,1,5,8", help="checkpoints: epochs of SGD before the weights freeze")
    parser.add_argument("--sizes", default="32,128,512", help="batch sizes B (halves of B/2)")
    parser.add_argument("--steps", type=int, default=300, help="logged optimizer steps per checkpoint and size")
    parser.add_argument("--draws", type=int, default=2000, help="Monte Carlo windows for the exact similarity")
    parser.add_argument("--variants", action="store_true", help="also print other smoothings of the same steps")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # a table, not a log per fit
    warnings.filterwarnings("ignore")
    epochs = [int(e) for e in args.epochs.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]

    start = time.perf_counter()
    x, y = digits_data()
    torch.manual_seed(0)
    net = digits_cnn_without_batchnorm()
    saved = checkpoints(net, x, y, epochs)
    print(f"digits CNN without BatchNorm, N = {len(x)}, {args.steps} logged steps per row (first {WARMUP} left out),")
    print(f"means +- standard errors; exact similarity by {args.draws} Monte Carlo draws of exact gradients\n")
    head = f"{'epoch':>5} {'B':>5} {'B_noise':>9} {'logged':>17} {'ratio':>6}  {'E[cos] exact':>16} {'closed':>7}"
    head += f" {'logged cos':>16} {'z':>6}"
    variants = list(VARIANTS) if args.variants else []
    head += "".join(f" {name:>8}" for name in variants)
    print(head)
    for epoch in epochs:
        net.load_state_dict(saved[epoch])
        truth = exact(net, x, y)
        for batch in sizes:
            logged = logged_at_frozen_weights(net, x, y, batch, args.steps)
            ns, ns_err, nan_share = mean_and_error(logged.noise_scale)
            cos, cos_err = truth.similarity(batch, args.draws, seed=batch)
            closed = expected_similarity(batch, truth.noise_scale, population=truth.n)
            sims = logged.similarity[WARMUP:]
            sim_mean = statistics.mean(sims)
            sim_err = statistics.stdev(sims) / math.sqrt(len(sims))  # steps' samples are drawn afresh: independent
            z = (sim_mean - cos) / math.hypot(sim_err, cos_err)
            line = (
                f"{epoch:5d} {batch:5d} {truth.noise_scale:9.1f} {ns:9.1f} +-{ns_err:6.1f}"
                f" {ns / truth.noise_scale:6.3f}  {cos:8.4f} +-{cos_err:.4f} {closed:7.4f}"
                f" {sim_mean:8.4f} +-{sim_err:.4f} {z:6.2f}"
            )
            if nan_share:
                line += f" (NaN on {nan_share:.0%})"
            for name in variants:
                value, _, nans = mean_and_error(VARIANTS[name](logged.raw))
                line += f" {value / truth.noise_scale:8.3f}" + ("*" if nans else "")
            print(line, flush=True)
    if variants:
        print("\nvariants: mean of what each smoothing logs over the same steps / exact B_noise (*: NaN on some steps)")
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

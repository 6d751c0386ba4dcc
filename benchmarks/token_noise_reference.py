"""The exact per-token noise scale of a tiny causal language model at fixed weights, against what ``SimiGrad`` logs.

    python benchmarks/token_noise_reference.py --quick   # ~1-2 min on 2 cores
    python benchmarks/token_noise_reference.py           # more sequences, steps and batch sizes: a few minutes

The text is the standard library's ``pydoc_data.topics`` (no download): its paragraphs as byte sequences of
9..``--max-length`` + 1 bytes, a sequence of ``n + 1`` bytes predicting its last ``n`` (``n`` its length and its loss
items). A small causal model (byte embedding, a causal convolution, a linear read-out) is trained briefly with Adam,
then frozen. Its loss on a micro-batch is the mean cross-entropy over the micro-batch's predicted tokens, so a step's
gradient is the token-weighted ``sum_i S_i / sum_i n_i`` (``S_i`` the gradient of sequence ``i``'s summed loss).

The truth, from every sequence's exact ``S_i`` (``torch.func`` ``vmap(grad)`` with masks, float64): the
token-weighted full gradient ``G = sum S_i / sum n_i`` and the effective per-token noise scale

    B_tok = mean_i |S_i - n_i G|^2 / (nbar |G|^2)

(``nbar`` the mean length): the noise of a step of ``T`` tokens is ``B_tok |G|^2 / T``. The logged
``simigrad/noise_scale`` counts samples (sequences): times the step's tokens per sample (``batch_size /
batch_samples``) it estimates ``B_tok``. The halves' expected similarity: by Monte Carlo over ``--draws`` windows of
whole sequences of the exact gradients (cut into two runs of about ``T / 2`` tokens, as the planner cuts them), its
standard error printed, beside the closed form ``expected_similarity`` of the step's samples at the noise scale in
samples ``B_tok / nbar`` over the ``N`` sequences (a ratio of expectations, not the mean cosine).

Then ``SimiGrad(adjust=False, lengths=..., max_micro_batch_tokens=..., loss_items=...)`` runs ``--steps`` steps of
``T`` tokens at those weights (SGD at lr 0); the table shows the mean logged noise scale in tokens and similarity after
the first 20 steps, with standard errors by batch means over blocks of 25 steps (the logged noise scale is an EMA).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
import warnings
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, Dataset

from lightning_simigrad import SimiGrad, expected_similarity

WARMUP, BLOCK = 20, 25


# ------------------------------------------------------------------------------------------------- data and model
def byte_sequences(count: int, max_length: int = 48, min_length: int = 8) -> list[torch.Tensor]:
    """The first ``count`` paragraphs of ``pydoc_data.topics`` as byte tensors of ``min_length + 1`` to
    ``max_length + 1`` bytes (longer paragraphs cut)."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for paragraph in topics[key].split("\n\n"):
            data = " ".join(paragraph.split()).encode("utf-8")[: max_length + 1]
            if len(data) > min_length:
                out.append(torch.tensor(list(data), dtype=torch.long))
                if len(out) == count:
                    return out
    raise ValueError(f"only {len(out)} paragraphs, asked for {count}")


class TinyCausal(nn.Module):
    """Byte embedding, a causal convolution over the last ``kernel`` bytes, tanh, a linear read-out."""

    def __init__(self, embed: int = 24, hidden: int = 48, kernel: int = 4) -> None:
        super().__init__()
        self.kernel = kernel
        self.embed = nn.Embedding(256, embed)
        self.conv = nn.Conv1d(embed, hidden, kernel)
        self.out = nn.Linear(hidden, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (m, L) -> (m, L, 256)
        h = self.embed(tokens).transpose(1, 2)
        h = nn.functional.pad(h, (self.kernel - 1, 0))
        return self.out(torch.tanh(self.conv(h)).transpose(1, 2))


def pad(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inputs (all bytes but the last), targets (all but the first) and mask, padded to the longest."""
    longest = max(len(s) for s in sequences) - 1
    inputs = torch.zeros(len(sequences), longest, dtype=torch.long)
    targets = torch.zeros_like(inputs)
    mask = torch.zeros(len(sequences), longest, dtype=torch.bool)
    for row, s in enumerate(sequences):
        n = len(s) - 1
        inputs[row, :n], targets[row, :n], mask[row, :n] = s[:-1], s[1:], True
    return {"inputs": inputs, "targets": targets, "mask": mask}


def summed_loss(net: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = net(batch["inputs"])
    per_token = nn.functional.cross_entropy(logits.transpose(1, 2), batch["targets"], reduction="none")
    return (per_token * batch["mask"]).sum()


def trained(sequences: list[torch.Tensor], steps: int, seed: int = 0) -> nn.Module:
    """``TinyCausal`` after ``steps`` Adam steps (lr 3e-3) on batches of 32 sequences."""
    torch.manual_seed(seed)
    net = TinyCausal()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(len(sequences), (32,), generator=gen).tolist()
        batch = pad([sequences[i] for i in idx])
        opt.zero_grad()
        (summed_loss(net, batch) / batch["mask"].sum()).backward()
        opt.step()
    return net


# ------------------------------------------------------------------------------------------------- the truth
@dataclass
class Truth:
    n: int  # sequences
    mean_length: float
    grad_sq: float  # |G|^2 of the token-weighted full gradient
    token_noise_scale: float  # B_tok
    gram: torch.Tensor  # [S_i . S_j]
    lengths: torch.Tensor  # n_i

    @property
    def sample_noise_scale(self) -> float:
        return self.token_noise_scale / self.mean_length

    def similarity(self, batch_samples: float) -> float:
        """The closed form (a ratio of expectations) for equal halves of ``batch_samples`` sequences."""
        return expected_similarity(batch_samples, self.sample_noise_scale, population=self.n)

    def monte_carlo_similarity(self, tokens: int, draws: int, seed: int = 0) -> tuple[float, float]:
        """Mean and standard error of cos(g_A, g_B) over ``draws`` windows of whole sequences drawn without
        replacement until they hold ``tokens`` tokens, cut into two runs of about ``tokens / 2`` each."""
        gen = torch.Generator().manual_seed(seed)
        cosines = []
        for _ in range(draws):
            order = torch.randperm(self.n, generator=gen)
            cumulative = self.lengths[order].cumsum(0)
            end = int(torch.searchsorted(cumulative, float(tokens))) + 1
            cut = int(torch.searchsorted(cumulative[:end], cumulative[end - 1] / 2)) + 1
            a, b = order[:cut], order[cut:end]
            dot = self.gram[a][:, b].sum()
            cosines.append(float(dot / (self.gram[a][:, a].sum() * self.gram[b][:, b].sum()).sqrt()))
        return statistics.mean(cosines), statistics.stdev(cosines) / math.sqrt(draws)


def exact(net: nn.Module, sequences: list[torch.Tensor], chunk: int = 64) -> Truth:
    """``B_tok`` from every sequence's exact gradient ``S_i`` (float64), accumulated a chunk at a time."""
    import copy

    net64 = copy.deepcopy(net).double()
    params = {k: v.detach() for k, v in net64.named_parameters()}

    def loss(p, inputs, targets, mask):
        one = {"inputs": inputs.unsqueeze(0), "targets": targets.unsqueeze(0), "mask": mask.unsqueeze(0)}
        return summed_loss(lambda x: functional_call(net64, p, (x,)), one)

    per_sequence = vmap(grad(loss), in_dims=(None, 0, 0, 0))
    lengths = torch.tensor([len(s) - 1 for s in sequences], dtype=torch.float64)
    sum_s = sum_ns = None
    sum_sq = 0.0
    rows = []
    for start in range(0, len(sequences), chunk):
        batch = pad(sequences[start : start + chunk])
        g = per_sequence(params, batch["inputs"], batch["targets"], batch["mask"])
        s = torch.cat([g[k].flatten(1) for k in params], dim=1)  # (m, P): S_i
        n = lengths[start : start + chunk]
        sum_s = s.sum(0) if sum_s is None else sum_s + s.sum(0)
        sum_ns = (n @ s) if sum_ns is None else sum_ns + n @ s
        sum_sq += float((s * s).sum())
        rows.append(s)
    G = sum_s / lengths.sum()
    grad_sq = float(G @ G)
    deviation = sum_sq - 2 * float(G @ sum_ns) + grad_sq * float((lengths**2).sum())  # sum_i |S_i - n_i G|^2
    mean_length = float(lengths.mean())
    noise = deviation / len(sequences) / (mean_length * grad_sq)
    s = torch.cat(rows)
    return Truth(len(sequences), mean_length, grad_sq, noise, s @ s.T, lengths)


# ------------------------------------------------------------------------------------------------- what is logged
class Indexed(Dataset):
    def __init__(self, sequences: list[torch.Tensor]) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.sequences[i]


class FrozenLM(pl.LightningModule):
    """``net`` under SGD at lr 0; the loss is the mean over the micro-batch's predicted tokens."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return summed_loss(self.net, batch) / batch["mask"].sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def predicted_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["mask"].sum()


@dataclass
class Logged:
    noise_tokens: list[float]  # logged noise scale x the step's tokens per sample
    similarity: list[float]
    samples: list[int]


def logged_at_frozen_weights(
    net: nn.Module, sequences: list[torch.Tensor], tokens: int, steps: int, cap: int, seed: int = 0
) -> Logged:
    """``SimiGrad(adjust=False)`` for ``steps`` steps of ``tokens`` tokens, micro-batches of at most ``cap``."""
    pl.seed_everything(seed, verbose=False)
    cb = SimiGrad(
        target_similarity=0.5,
        adjust=False,
        lengths=[len(s) - 1 for s in sequences],
        max_micro_batch_tokens=cap,
        loss_items=predicted_tokens,
        initial_batch_size=tokens,
        schedule_by_samples=False,
    )
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
        callbacks=[cb],
    )
    trainer.fit(FrozenLM(net), DataLoader(Indexed(sequences), batch_size=8, shuffle=True, collate_fn=pad))
    rows = cb.history
    return Logged(
        [h["noise_scale"] * h["batch_size"] / h["batch_samples"] for h in rows],
        [h["similarity"] for h in rows],
        [h["batch_samples"] for h in rows],
    )


def mean_and_error(values: list[float]) -> tuple[float, float]:
    """Mean after the warm-up and its standard error by batch means over blocks of ``BLOCK`` steps."""
    values = [v for v in values[WARMUP:] if math.isfinite(v)]
    blocks = [statistics.mean(values[i : i + BLOCK]) for i in range(0, len(values) - BLOCK + 1, BLOCK)]
    error = statistics.stdev(blocks) / math.sqrt(len(blocks)) if len(blocks) > 1 else math.nan
    return statistics.mean(values), error


@dataclass
class Row:
    tokens: int
    truth: Truth
    logged_noise: float
    logged_noise_error: float
    expected_cos: float  # the closed form
    exact_cos: float  # Monte Carlo over windows of the exact gradients
    exact_cos_error: float
    logged_cos: float
    logged_cos_error: float

    @property
    def ratio(self) -> float:
        return self.logged_noise / self.truth.token_noise_scale

    @property
    def noise_z(self) -> float:
        return (self.logged_noise - self.truth.token_noise_scale) / self.logged_noise_error

    @property
    def cos_z(self) -> float:
        return (self.logged_cos - self.exact_cos) / math.hypot(self.logged_cos_error, self.exact_cos_error)


def measure(
    net: nn.Module, sequences: list[torch.Tensor], truth: Truth, tokens: int, steps: int, cap: int, draws: int = 2000
) -> Row:
    logged = logged_at_frozen_weights(net, sequences, tokens, steps, cap)
    noise, noise_error = mean_and_error(logged.noise_tokens)
    sims = logged.similarity[WARMUP:]
    expected = statistics.mean(truth.similarity(m) for m in logged.samples[WARMUP:])
    cos_error = statistics.stdev(sims) / math.sqrt(len(sims))  # each step's samples drawn afresh: independent
    exact_cos, exact_error = truth.monte_carlo_similarity(tokens, draws, seed=tokens)
    return Row(tokens, truth, noise, noise_error, expected, exact_cos, exact_error, statistics.mean(sims), cos_error)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="400 sequences, 150 steps, one batch size")
    parser.add_argument("--sequences", type=int, default=1000)
    parser.add_argument("--max-length", type=int, default=48)
    parser.add_argument("--train-steps", type=int, default=20, help="Adam steps before the weights freeze")
    parser.add_argument("--tokens", default="256,1024", help="batch sizes in tokens")
    parser.add_argument("--steps", type=int, default=400, help="logged optimizer steps per batch size")
    parser.add_argument("--cap", type=int, default=256, help="max_micro_batch_tokens")
    parser.add_argument("--draws", type=int, default=2000, help="Monte Carlo windows for the exact similarity")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.quick:
        args.sequences, args.steps, args.tokens = 400, 150, "512"
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    sequences = byte_sequences(args.sequences, args.max_length)
    net = trained(sequences, args.train_steps)
    truth = exact(net, sequences)
    print(
        f"pydoc_data.topics, N = {truth.n} sequences of {truth.mean_length:.1f} predicted bytes on average, "
        f"{args.train_steps} Adam steps; |G|^2 = {truth.grad_sq:.4g}, B_tok = {truth.token_noise_scale:.1f} tokens "
        f"({truth.sample_noise_scale:.2f} sequences); exact in {time.perf_counter() - start:.0f} s"
    )
    print(f"{args.steps} logged steps per row (first {WARMUP} left out), max_micro_batch_tokens = {args.cap}\n")
    head = f"{'T':>6} {'B_tok':>8} {'logged x T/m':>18} {'ratio':>6} {'z':>6}  {'closed':>7} {'E[cos] exact':>16}"
    print(head + f" {'logged cos':>16} {'z':>6}")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        row = measure(net, sequences, truth, tokens, args.steps, args.cap, args.draws)
        print(
            f"{tokens:6d} {truth.token_noise_scale:8.1f} {row.logged_noise:9.1f} +-{row.logged_noise_error:6.1f}"
            f" {row.ratio:6.3f} {row.noise_z:6.2f}  {row.expected_cos:7.4f}"
            f" {row.exact_cos:8.4f} +-{row.exact_cos_error:.4f} {row.logged_cos:8.4f}"
            f" +-{row.logged_cos_error:.4f} {row.cos_z:6.2f}",
            flush=True,
        )
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

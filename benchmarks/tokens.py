"""Batches in tokens: what `loss_items` costs, and what token-budgeted, length-grouped windows save in padding.

    python benchmarks/tokens.py                  # ~4 minutes on 2 CPU cores
    python benchmarks/tokens.py --rounds 9 --steps 40

A language-model-style module (token embedding, a two-layer MLP per token, the vocabulary projection: 2.4M
parameters) on sequences of 16 to 128 tokens, padded to the longest of their micro-batch (16), labels -100 on
padding and on a prompt of up to a quarter of each sequence, ``training_step`` returning the mean over the labelled
tokens. Both sides run ``SimiGrad(adjust=False)`` (the halves measured every step, the batch held at 4
micro-batches); the *items* side also counts each micro-batch's labelled tokens (``loss_items``) and rescales the
gradient once per step. The sides run in turn, round by round, the order alternating; each round compares the
median optimizer-step times (wall and CPU), and the medians over rounds are printed last.

Then the padding: ``SimiGrad(lengths=..., max_micro_batch_tokens=16 x 128)`` (windows of B0 = 64 x the mean length
tokens, samples of alike length together, at most the padded tokens of a plain micro-batch of 16 of the longest)
against the same module fed shuffled micro-batches of 16 samples (SimiGrad counting samples, B0 = 64: a plain
shuffled DataLoader's batches), both ``adjust=False`` at the same tokens per step: the padding fraction of every
micro-batch trained (padded tokens not in any sequence, over all padded tokens) and the real tokens per second of
step time, in alternating rounds.
"""

from __future__ import annotations

import argparse
import statistics

import lightning.pytorch as pl
import torch
from overhead import StepTimer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_simigrad import SimiGrad

VOCAB, WIDTH, MICRO, WINDOW = 4096, 256, 16, 4


class Documents(Dataset):
    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(16, 129, (n,), generator=g).tolist()
        self.tokens = [torch.randint(1, VOCAB, (length,), generator=g) for length in lengths]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


def pad(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    labels = torch.full((len(sequences), longest), -100)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = s
        labels[row, len(s) // 4 : len(s) - 1] = s[len(s) // 4 + 1 :]  # next token, after the prompt
    return {"input_ids": ids, "labels": labels}


def labelled(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"] != -100).sum()


class TokenLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def training_step(self, batch, batch_idx):
        hidden = self.embed(batch["input_ids"])
        logits = self.head(hidden + self.mlp(hidden))
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def timed_fit(items: bool, steps: int, data: Documents) -> tuple[float, float]:
    torch.manual_seed(0)
    timer = StepTimer(warmup=2)
    simigrad = SimiGrad(0.8, adjust=False, initial_batch_size=MICRO * WINDOW, loss_items=labelled if items else None)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=[simigrad, timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TokenLM(), DataLoader(data, batch_size=MICRO, shuffle=True, collate_fn=pad))
    return statistics.median(timer.times), statistics.median(timer.cpu_times)


class PaddedTokens(pl.Callback):
    """Real and padded tokens of every micro-batch trained."""

    def __init__(self) -> None:
        self.real = self.padded = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.real += int((batch["input_ids"] != 0).sum())
        self.padded += batch["input_ids"].numel()


def padding_fit(budgeted: bool, steps: int, data: Documents) -> tuple[float, float]:
    """Padding fraction and real tokens per second of step time, in token windows (``budgeted``) or sample ones."""
    torch.manual_seed(0)
    timer, tokens = StepTimer(warmup=2), PaddedTokens()
    lengths = [len(t) for t in data.tokens]
    mean = sum(lengths) / len(lengths)
    if budgeted:
        simigrad = SimiGrad(
            0.8, adjust=False, initial_batch_size=round(MICRO * WINDOW * mean), lengths=lengths,
            max_micro_batch_tokens=MICRO * 128, loss_items=labelled,
        )  # fmt: skip
    else:
        simigrad = SimiGrad(0.8, adjust=False, initial_batch_size=MICRO * WINDOW, loss_items=labelled)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=[simigrad, timer, tokens],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TokenLM(), DataLoader(data, batch_size=MICRO, shuffle=True, collate_fn=pad))
    per_step = MICRO * WINDOW * mean
    return 1 - tokens.real / tokens.padded, per_step / statistics.median(timer.times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    data = Documents(MICRO * WINDOW * (args.steps + 2))
    params = sum(p.numel() for p in TokenLM().parameters())
    print(f"token LM: {params / 1e6:.1f}M parameters; micro-batch {MICRO}, window {WINDOW}")
    wall, cpu = [], []
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        times = {items: timed_fit(items, args.steps, data) for items in order}
        wall.append(times[True][0] / times[False][0])
        cpu.append(times[True][1] / times[False][1])
        print(
            f"round {round_}: samples {times[False][0] * 1e3:.1f} ms/step, items {times[True][0] * 1e3:.1f} ms/step"
            f" (wall {wall[-1]:.3f}, CPU {cpu[-1]:.3f})"
        )
    print(
        f"loss_items / samples: median wall-time ratio {statistics.median(wall):.3f}, median CPU-time ratio"
        f" {statistics.median(cpu):.3f}"
    )
    fractions: dict[bool, list[float]] = {False: [], True: []}
    speed = []
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        results = {budgeted: padding_fit(budgeted, args.steps, data) for budgeted in order}
        for budgeted, (fraction, _) in results.items():
            fractions[budgeted].append(fraction)
        speed.append(results[True][1] / results[False][1])
        print(
            f"round {round_}: padding {results[False][0]:.3f} in batches of {MICRO} samples, {results[True][0]:.3f} in"
            f" token windows; tokens/s {results[False][1]:.0f} and {results[True][1]:.0f} (ratio {speed[-1]:.3f})"
        )
    print(
        f"padding fraction: {statistics.median(fractions[False]):.3f} shuffled batches of {MICRO},"
        f" {statistics.median(fractions[True]):.3f} token windows grouped by length; tokens/s ratio (token windows /"
        f" batches) {statistics.median(speed):.3f}"
    )


if __name__ == "__main__":
    main()

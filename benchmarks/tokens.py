"""What `loss_items` costs: SimiGrad's step time with token weighting against without, side by side.

    python benchmarks/tokens.py                  # ~2 minutes on 2 CPU cores
    python benchmarks/tokens.py --rounds 9 --steps 40

A language-model-style module (token embedding, a two-layer MLP per token, the vocabulary projection: 2.4M
parameters) on sequences of 16 to 128 tokens, padded to the longest of their micro-batch (16), labels -100 on
padding and on a prompt of up to a quarter of each sequence, ``training_step`` returning the mean over the labelled
tokens. Both sides run ``SimiGrad(adjust=False)`` (the halves measured every step, the batch held at 4
micro-batches); the *items* side also counts each micro-batch's labelled tokens (``loss_items``) and rescales the
gradient once per step. The sides run in turn, round by round, the order alternating; each round compares the
median optimizer-step times (wall and CPU), and the medians over rounds are printed last.

Not measured here yet: the padding fraction of token-budgeted, length-grouped windows against a plain DataLoader
(batches stated in tokens are not built).
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


if __name__ == "__main__":
    main()

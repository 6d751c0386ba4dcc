"""Step-time overhead of SimiGrad on one process, against plain Lightning accumulation.

    python benchmarks/overhead.py                   # the MLP, ~6 minutes on 2 CPU cores
    python benchmarks/overhead.py --model all       # also ResNet-18 and a tiny BERT (many parameter tensors)
    python benchmarks/overhead.py --model resnet18 --pairs 3 --steps 12 --micro 8

Models: ``mlp`` (~10M parameters in 8 tensors), ``resnet18`` (torchvision's, 32x32 inputs: 11M parameters in
62 tensors) and ``bert_tiny`` (a 4-layer BERT masked LM from a config, hidden size 128: 1.4M parameters in 72
tensors). The many-tensor models show what the measurement costs per parameter tensor, which is what a GPU's
kernel launches pay for (``benchmarks/launches.py`` counts the ops).

Both sides train the same ~10M-parameter MLP with the same micro-batch (``--micro``, 32) and window (4
micro-batches, a global batch of 128): plain Lightning with ``accumulate_grad_batches=4``, and SimiGrad with
``adjust=False`` (it measures the halves every step -- a midpoint snapshot and three dot products -- but
keeps the batch fixed, so both sides do the same arithmetic otherwise). The two run alternately, pair by
pair, in this one process; each pair's ratio compares the median optimizer-step time of the two fits,
and the median over pairs is printed last. Goal: <= 1.05.
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_simigrad import SimiGrad

WINDOW = 4


def _net(name: str) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(
            nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
            nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 512),
        )  # fmt: skip
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10)
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=2, intermediate_size=512, vocab_size=2000
    )
    return BertForMaskedLM(config)


def _data(name: str, n: int) -> TensorDataset:
    if name == "mlp":
        return TensorDataset(torch.randn(n, 1024), torch.randint(0, 512, (n,)))
    if name == "resnet18":
        return TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    tokens = torch.randint(0, 2000, (n, 32))
    return TensorDataset(tokens, tokens.clone())


class MLP(pl.LightningModule):
    """The benchmark's module (named for its first model); ``name`` picks the network."""

    def __init__(self, name: str = "mlp") -> None:
        super().__init__()
        self.name = name
        self.net = _net(name)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.name == "bert_tiny":
            return self.net(input_ids=x, labels=y).loss
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepTimer(pl.Callback):
    """Wall and process CPU time between consecutive optimizer steps, after a warm-up.

    CPU time is the steadier figure on a shared machine: another tenant's load stretches wall time but
    not the cycles this process spends.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self._last: tuple[float, float] | None = None

    def on_before_zero_grad(self, trainer, pl_module, optimizer):  # once per window, at its start
        now = (time.perf_counter(), time.process_time())
        if self._last is not None and trainer.global_step > self.warmup:
            self.times.append(now[0] - self._last[0])
            self.cpu_times.append(now[1] - self._last[1])
        self._last = now


def timed_fit(
    use_simigrad: bool, steps: int, data: TensorDataset, micro: int, name: str = "mlp"
) -> tuple[float, float]:
    torch.manual_seed(0)
    timer = StepTimer(warmup=2)
    callbacks: list[pl.Callback] = [timer]
    if use_simigrad:
        callbacks.insert(0, SimiGrad(target_similarity=0.8, adjust=False))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        accumulate_grad_batches=WINDOW,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MLP(name), DataLoader(data, batch_size=micro, shuffle=True))
    return statistics.median(timer.times), statistics.median(timer.cpu_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro", type=int, default=32, help="micro-batch size (the window is 4 of them)")
    parser.add_argument("--model", choices=("mlp", "resnet18", "bert_tiny", "all"), default="mlp")
    args = parser.parse_args()
    for name in ("mlp", "resnet18", "bert_tiny") if args.model == "all" else (args.model,):
        measure(name, args.pairs, args.steps, args.micro)


def measure(name: str, pairs: int, steps: int, micro: int) -> None:
    n = micro * WINDOW * (steps + 2)
    data = _data(name, n)
    net = _net(name)
    params, tensors = sum(p.numel() for p in net.parameters()), len(list(net.parameters()))
    threads = torch.get_num_threads()
    print(
        f"model {name}: {params / 1e6:.1f}M parameters in {tensors} tensors; micro-batch {micro}, window {WINDOW},"
        f" {threads} threads"
    )
    ratios, cpu_ratios = [], []
    for pair in range(pairs):
        # alternate which side runs first, so drift in the machine's speed falls on both
        order = (False, True) if pair % 2 == 0 else (True, False)
        times = {side: timed_fit(side, steps, data, micro, name) for side in order}
        ratios.append(times[True][0] / times[False][0])
        cpu_ratios.append(times[True][1] / times[False][1])
        plain, ours = times[False][0] * 1e3, times[True][0] * 1e3
        print(
            f"pair {pair}: plain {plain:7.1f} ms/step   simigrad {ours:7.1f} ms/step   ratio {ratios[-1]:.3f}"
            f"   (CPU time ratio {cpu_ratios[-1]:.3f})"
        )
    print(f"{name}: median CPU-time ratio: {statistics.median(cpu_ratios):.3f}")
    print(
        f"{name}: median step-time ratio SimiGrad(adjust=False) / plain accumulation: {statistics.median(ratios):.3f}"
    )


if __name__ == "__main__":
    main()

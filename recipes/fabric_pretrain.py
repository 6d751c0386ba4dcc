"""``simigrad-fabric-pretrain``: a tiny GPT pretrained by a Fabric loop written as LitGPT writes its own, with SimiGrad
choosing every step's batch in tokens.

    simigrad-fabric-pretrain                                  # pydoc's topics text, one CPU process, a few minutes
    simigrad-fabric-pretrain --max-tokens 20000 --n-layer 1 --n-embd 32    # a smoke run, under a minute
    simigrad-fabric-pretrain --source stdlib --max-tokens 3000000 --devices 2 --strategy ddp
    simigrad-fabric-pretrain --resume outputs/fabric/last.ckpt --max-tokens 200000

The loop is LitGPT's ``pretrain.fit`` in shape: ``fabric.launch``, ``fabric.setup``, the state dict that
``fabric.save`` / ``fabric.load`` checkpoint, ``fabric.no_backward_sync`` while accumulating, ``fabric.backward``,
gradient clipping, ``fabric.log_dict``. What SimiGrad changes is the accumulation: LitGPT fixes it from
``global_batch_size / micro_batch_size``; here every step's window comes from
:class:`~lightning_simigrad.fabric.FabricSimiGrad` (docs/fabric.md shows the loop before and after). The model is a
GPT-2 built from a small config (``transformers.GPT2LMHeadModel``), the data the causal-LM recipe's
(:mod:`lightning_simigrad_recipes.data.documents`): each document tokenized whole by a byte-level BPE trained here and
cut into samples of at most 128 tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "pretrain"]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="simigrad-fabric-pretrain", description=__doc__.split("\n\n")[0])
    p.add_argument("--source", choices=["pydoc", "stdlib"], default="pydoc", help="the corpus (both ship with Python)")
    p.add_argument(
        "--max-tokens", type=int, default=300_000, help="the fit's budget in tokens (SimiGrad's max_samples)"
    )
    p.add_argument("--initial-batch", type=int, default=2048, help="B0 in tokens; the learning rate belongs to it")
    p.add_argument("--micro-batch-tokens", type=int, default=2048, help="most padded tokens of a micro-batch")
    p.add_argument("--target-similarity", type=float, default=0.3)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's rate at B0")
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping, as LitGPT's train.max_norm")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="auto", help="Fabric's: auto, ddp, fsdp, ...")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--save-interval", type=int, default=0, help="optimizer steps between checkpoints (0: at the end)")
    p.add_argument("--resume", default=None, help="a checkpoint this script wrote")
    p.add_argument("--out", default="outputs/fabric", help="checkpoints and the metrics' CSV go here")
    p.add_argument("--cache-dir", default="~/.cache/lightning-simigrad", help="tokenizer and token ids")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    return p.parse_args(argv)


def pretrain(args: argparse.Namespace) -> dict[str, Any]:
    """Launch Fabric and run the loop; returns rank zero's summary."""
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import CSVLogger

    logger = CSVLogger(args.out, name="metrics", version=0)
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy, loggers=[logger])
    fabric.launch()
    return fit(fabric, args)


def fit(fabric: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch import nn
    from transformers import GPT2LMHeadModel

    from lightning_simigrad.fabric import FabricSimiGrad
    from lightning_simigrad_recipes.data.documents import DocumentsDataModule, sample_tokens
    from lightning_simigrad_recipes.models.causal_lm import gpt2_config

    fabric.seed_everything(args.seed)
    data = DocumentsDataModule(
        source=args.source, tokenizer={"train": True, "vocab_size": 2048}, cache_dir=args.cache_dir, batch_size=16
    )
    data.output_dir = Path(args.out)
    with fabric.rank_zero_first():  # one process trains the tokenizer and fills the cache; the others read it
        data.setup("fit")
    tokenizer = data.tokenizer
    config = {"n_layer": args.n_layer, "n_head": 2, "n_embd": args.n_embd, "n_positions": data.max_seq_length}
    with fabric.init_module():
        model = GPT2LMHeadModel(gpt2_config(config, len(tokenizer), tokenizer.pad_token_id, data.max_seq_length))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)

    def loss_items(batch: dict[str, torch.Tensor]) -> torch.Tensor:  # the tokens a micro-batch's loss averages
        return (batch["labels"][:, 1:] != -100).sum()

    simigrad = FabricSimiGrad(
        fabric,
        target_similarity=args.target_similarity,
        initial_batch_size=args.initial_batch,
        lengths=sample_tokens,
        max_micro_batch_tokens=args.micro_batch_tokens,
        loss_items=loss_items,
        max_samples=args.max_tokens,
    )
    simigrad.setup(model, optimizer, data.train_dataloader())
    state = {"model": model, "optimizer": optimizer, "simigrad": simigrad}
    if args.resume:
        fabric.load(args.resume, state)

    out = Path(args.out)
    started = time.perf_counter()
    for window in simigrad.windows():
        for batch in window:
            with fabric.no_backward_sync(model, enabled=window.accumulating):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                targets = batch["labels"][:, 1:]
                # the mean over the micro-batch's predicted tokens (none: 0, which loss_items weighs by zero)
                loss = nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.size(-1)),
                    targets.reshape(-1),
                    ignore_index=-100,
                    reduction="sum",
                ) / max(int((targets != -100).sum()), 1)
                fabric.backward(window.scale(loss))
        window.finish()
        fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        step = window.step(optimizer)
        optimizer.zero_grad()
        fabric.log_dict({"train/loss": float(loss.detach())}, step=step.index)
        if args.save_interval and (step.index + 1) % args.save_interval == 0:
            fabric.save(out / "last.ckpt", state)
    fabric.save(out / "last.ckpt", state)
    history = simigrad.history
    summary = {
        "steps": len(history),
        "first_step": int(history[0]["step"]) if history else None,
        "tokens_seen": int(history[-1]["tokens_seen"]) if history else 0,
        "batch_range": [min(h["batch_size"] for h in history), max(h["batch_size"] for h in history)]
        if history
        else [],
        "last_loss": float(loss.detach()) if history else math.nan,
        "train_seconds": round(time.perf_counter() - started, 1),
        "checkpoint": str(out / "last.ckpt"),
    }
    if fabric.is_global_zero:
        fabric.print(json.dumps(summary))
    fabric.logger.finalize("success")
    return summary


def main() -> None:
    pretrain(parse(sys.argv[1:]))


if __name__ == "__main__":
    main()

"""``trainer=fsdp`` for the BERT recipes: the composed config, the sharded LAMB, and ``debug=smoke trainer=fsdp``
run as users run it (two CPU processes, the second started by Lightning's subprocess launcher)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from lightning_simigrad_recipes.optim import ShardedLamb
from lightning_simigrad_recipes.train import CONFIG_MODULE, _apply_smoke

FSDP2 = "lightning_simigrad_recipes.strategies.FSDP2Strategy"


def compose_cfg(overrides: list[str]):
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return _apply_smoke(compose(config_name="train", overrides=overrides))


@pytest.mark.parametrize(
    "experiment", ["bert_tiny_pydoc", "bert_tiny_stdlib", "bert_large_pretrain", "bert_large_phase2"]
)
def test_trainer_fsdp_composes_for_the_bert_recipes(experiment: str) -> None:
    cfg = compose_cfg([f"experiment={experiment}", "trainer=fsdp"])
    assert cfg.trainer.strategy._target_ == FSDP2 and cfg.trainer.strategy.tensor_parallel_size == 1
    assert cfg.trainer.strategy.process_group_backend is None  # NCCL on GPUs, gloo on CPU
    assert cfg.model.config  # the experiment's own settings stay
    smoke = compose_cfg([f"experiment={experiment}", "trainer=fsdp", "debug=smoke"])
    assert smoke.trainer.devices == 2 and smoke.trainer.accelerator == "cpu" and smoke.trainer.max_steps == 4
    assert smoke.trainer.strategy._target_ == FSDP2 and smoke.trainer.strategy.process_group_backend == "gloo"
    # the other trainers' smoke runs are still one CPU process
    plain = compose_cfg([f"experiment={experiment}", "trainer=ddp", "debug=smoke"])
    assert plain.trainer.devices == 1 and plain.trainer.strategy == "auto"


def _groups(module: torch.nn.Module) -> list[dict]:
    params = list(module.parameters())
    return [
        {"params": [p for p in params if p.ndim > 1]},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _train(module: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 15) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 2, generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(module(x), y).backward()
        optimizer.step()


def test_sharded_lamb_is_pytorch_optimizers_lamb_on_plain_tensors() -> None:
    import pytorch_optimizer

    a, b = _net(), _net()
    kwargs = dict(lr=5e-3, betas=(0.9, 0.999), weight_decay=0.01, eps=1e-6)
    _train(a, pytorch_optimizer.Lamb(_groups(a), **kwargs))
    _train(b, ShardedLamb(_groups(b), **kwargs))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def _sharded_against_unsharded(rank: int, world: int) -> float:
    import pytorch_optimizer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    reference, sharded = _net(), _net()
    fully_shard(sharded[0], mesh=mesh)
    fully_shard(sharded[2], mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    kwargs = dict(lr=5e-3, weight_decay=0.01)
    _train(reference, pytorch_optimizer.Lamb(_groups(reference), **kwargs))  # every rank feeds the same data
    _train(sharded, ShardedLamb(_groups(sharded), **kwargs))
    return max(float((p - q.full_tensor()).abs().max()) for p, q in zip(reference.parameters(), sharded.parameters()))


@pytest.mark.timeout(120)
def test_sharded_lamb_on_fsdp2_shards_is_the_unsharded_lamb(run_ok) -> None:
    # whole-parameter trust ratios from one all-reduce of the shards' squared norms, not per-shard ones
    assert max(run_ok(_sharded_against_unsharded, 2, deadline_s=100)) < 1e-6


@pytest.mark.timeout(300)
def test_bert_tiny_pydoc_smoke_under_fsdp_on_two_cpu_processes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1")
    run_dir = tmp_path / "run"
    argv = ["experiment=bert_tiny_pydoc", "debug=smoke", "trainer=fsdp", "logger=csv", "num_threads=1"]
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_simigrad_recipes.train", *argv, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Starting with 2 processes" in proc.stdout + proc.stderr  # Lightning started the second rank itself
    assert (run_dir / "train_ddp_process_1.log").is_file()  # rank 1's log, in the same run directory
    with (run_dir / "simigrad_trace.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rows and sum(float(r["batch_size"]) for r in rows) == 32  # debug=smoke: 4 steps of B0 = 8, in samples
    assert all(float(r["accumulation"]) >= 2 for r in rows)  # the halves in time: two micro-batches per rank
    assert "val/loss" in proc.stdout


def test_an_optimizer_without_sharded_support_is_refused() -> None:
    import functools

    import pytorch_optimizer

    from lightning_simigrad_recipes.errors import RecipeError
    from lightning_simigrad_recipes.models.masked_lm import _for_sharded_parameters

    lamb = _for_sharded_parameters(functools.partial(pytorch_optimizer.Lamb, lr=1e-3, weight_decay=0.01))
    assert lamb.func is ShardedLamb and lamb.keywords == {"lr": 1e-3, "weight_decay": 0.01}  # type: ignore[attr-defined]
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)
    assert _for_sharded_parameters(adamw) is adamw  # torch's optimizers take DTensors as they are
    with pytest.raises(RecipeError, match="LARS does not support sharded parameters"):
        _for_sharded_parameters(functools.partial(pytorch_optimizer.LARS, lr=1.0))
    with pytest.raises(RecipeError, match="not \\['clamp'\\]"):
        _for_sharded_parameters(functools.partial(pytorch_optimizer.Lamb, lr=1e-3, clamp=5.0))


def test_trainer_fsdp_with_a_module_that_does_not_shard_itself_is_a_user_error(tmp_path: Path) -> None:
    from lightning_simigrad_recipes.errors import RecipeError
    from lightning_simigrad_recipes.train import train

    cfg = compose_cfg(["trainer=fsdp", "debug=smoke", "logger=none", f"output_dir={tmp_path}"])  # digits' CNN
    with pytest.raises(RecipeError, match="ImageClassifier does not shard itself"):
        train(cfg)  # before any Trainer (and its launcher) exists

"""``simigrad-train``: compose a Hydra config from the shipped configs and train one recipe.

    simigrad-train                                            # digits on CPU, ~13 s of training
    simigrad-train experiment=resnet18_cifar10 data.root=/data/cifar-10-batches-py
    simigrad-train -m experiment=resnet18_cifar10 simigrad=paper,off seed=1,2,3
    simigrad-train experiment=resnet50_imagenet data.root=/data/imagenet debug=smoke

``main()`` is the thin ``@hydra.main`` entry; ``train(cfg)`` is a plain function that tests call
with a composed config. User errors (a wrong path, an unknown option) end as one ``error: ...``
line on stderr and exit code 2.

The configs are the package ``lightning_simigrad_recipes.conf`` (the repository's ``conf/``, see
``setup.py``), read through Hydra's ``pkg://`` search path: a wheel, an editable install and a checkout
find them alike, without environment variables. ``--config-dir DIR`` adds a user's folder beside them.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, InstantiationException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_simigrad_recipes.errors import RecipeError

if TYPE_CHECKING:
    import lightning.pytorch as pl

# torch, Lightning and the recipe modules are imported inside train(): a mistyped option is then
# reported in a second or two instead of after Lightning's import.


# The shipped configs; compose them in-process with hydra.initialize_config_module(CONFIG_MODULE).
CONFIG_MODULE = "lightning_simigrad_recipes.conf"


# `${if_cuda:16-mixed,32-true}`: mixed precision where a GPU is present, full precision on CPU.
def _if_cuda(gpu: str, cpu: str) -> str:
    import torch

    return gpu if torch.cuda.is_available() else cpu


OmegaConf.register_new_resolver("if_cuda", _if_cuda, replace=True)


def _output_dir(cfg: DictConfig) -> Path:
    if cfg.get("output_dir"):
        return Path(cfg.output_dir)
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path("outputs") / str(cfg.get("name", "run")) / time.strftime("%Y-%m-%d_%H-%M-%S")


def _simigrad_label(cfg: DictConfig) -> str:
    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.choices.get("simigrad", "simigrad"))
    if not cfg.simigrad.get("adjust", True):
        return "off"
    return str(cfg.simigrad.get("controller", "paper"))


def _apply_smoke(cfg: DictConfig) -> DictConfig:
    """``debug=smoke`` sets ``smoke_run``; each experiment's ``smoke`` block then swaps in its small variant."""
    if not cfg.get("smoke_run") or not cfg.get("smoke"):
        return cfg
    smoke = cfg.smoke
    merged = OmegaConf.merge(cfg, smoke)
    assert isinstance(merged, DictConfig)
    return merged


def _logger(cfg: DictConfig, out: Path, run_name: str) -> Any:
    from hydra.utils import instantiate

    if not cfg.get("logger"):
        return False
    save_dir = (
        cfg.logger.get("save_dir")
        or (os.environ.get("WANDB_DIR") if "wandb" in str(cfg.logger.get("_target_", "")) else None)
        or str(out)
    )
    kwargs: dict[str, Any] = {"save_dir": save_dir}
    if "wandb" in str(cfg.logger.get("_target_", "")) and not cfg.logger.get("name"):
        kwargs["name"] = run_name
    return instantiate(cfg.logger, **kwargs)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train the recipe ``cfg`` describes; return its metrics, trace paths and batch-size range.

    Returns:
        ``{"metrics": {name: value}, "output_dir", "trace_csv", "trace_png", "unit" ("samples" or "tokens": what the
        batch sizes count), "initial_batch_size" (B0), "first_step_batch_size", "last_step_batch_size",
        "final_batch_size" (the batch the callback would plan next, not trained), "min_batch_size", "max_batch_size"
        (over the steps trained), "steps", "samples_seen", "tokens_seen" (batches in tokens)}`` (the trace entries
        are absent when no SimiGrad callback ran, e.g. with ``simigrad=null``).

    Raises:
        RecipeError: for user errors found before training (paths, data layout, tokenizer).
    """
    import lightning.pytorch as pl
    import torch
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import WandbLogger

    from lightning_simigrad_recipes.trace import SimiGradTrace

    cfg = _apply_smoke(cfg)
    _check_required(cfg)
    out = _output_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.get("num_threads"):
        torch.set_num_threads(int(cfg.num_threads))
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    datamodule = instantiate(cfg.data)
    datamodule.output_dir = out
    datamodule.check_inputs()  # stop on a wrong path before building model and Trainer
    optimizer = instantiate(cfg.optimizer)
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    model = instantiate(cfg.model, optimizer=optimizer, scheduler=scheduler, **datamodule.model_kwargs())
    _check_sharding(cfg, model)

    run_name = f"{cfg.name}-{_simigrad_label(cfg)}-seed{cfg.seed}"
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    trace = SimiGradTrace(out, run_config=resolved, title=run_name)
    callbacks: list[pl.Callback] = [trace]
    if cfg.get("simigrad"):
        callbacks.insert(0, instantiate(cfg.simigrad))
        if cfg.simigrad.get("elastic") and cfg.trainer.get("enable_checkpointing", True):
            # every start of an elastic run resumes from one folder: ckpt_path=last finds the newest last*.ckpt there
            # (the request's last-simigrad.ckpt too), whatever folder a logger would give this start's checkpoints
            from lightning.pytorch.callbacks import ModelCheckpoint

            callbacks.append(ModelCheckpoint(dirpath=out / "checkpoints", save_last=True))
    logger = _logger(cfg, out, run_name)
    if logger:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    trainer: pl.Trainer = instantiate(
        cfg.trainer, callbacks=callbacks, logger=logger, default_root_dir=str(out), **_elastic_world(cfg)
    )

    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        if not any(k.startswith("val/") for k in trainer.callback_metrics):
            trainer.validate(model, datamodule=datamodule, verbose=False)  # stopped by max_steps mid-epoch
    finally:
        if isinstance(logger, WandbLogger) and trainer.is_global_zero:
            logger.experiment.finish()

    result: dict[str, Any] = {
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "output_dir": str(out),
        **trace.summary(),
    }
    if trainer.is_global_zero:
        _report(run_name, result)
    return result


def _elastic_world(cfg: DictConfig) -> dict[str, int]:
    """Under an elastic torchrun (``--nnodes=MIN:MAX``) the world is what the rendezvous gave, which changes from one
    start to the next: the Trainer's devices and nodes are read from torchrun's environment rather than the config
    (Lightning refuses a product that differs from ``WORLD_SIZE``)."""
    import os

    simigrad = cfg.get("simigrad")
    if not (simigrad and simigrad.get("elastic") and "TORCHELASTIC_RUN_ID" in os.environ):
        return {}
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    return {"devices": local, "num_nodes": int(os.environ["WORLD_SIZE"]) // local}


def _check_required(cfg: DictConfig) -> None:
    """Settings an experiment leaves to the user (``???``, e.g. phase 2's ``model.init_from``), before any work."""
    missing = sorted(_missing_keys(OmegaConf.to_container(cfg, resolve=False)))  # unresolved: no resolver runs
    if missing:
        experiment = _experiment_name(cfg)
        raise RecipeError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set and experiment={experiment} needs"
            f" {'it' if len(missing) == 1 else 'them'}: add {' '.join(f'{key}=...' for key in missing)} to the command"
            f" (conf/experiment/{experiment}.yaml says what each takes)"
        )


def _missing_keys(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [key for k, v in node.items() for key in _missing_keys(v, f"{prefix}{k}.")]
    if isinstance(node, list):
        return [key for i, v in enumerate(node) for key in _missing_keys(v, f"{prefix}{i}.")]
    return [prefix[:-1]] if node == "???" else []


def _experiment_name(cfg: DictConfig) -> str:
    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.choices.get("experiment", cfg.get("name", "?")))
    return str(cfg.get("name", "?"))


def _check_sharding(cfg: DictConfig, model: pl.LightningModule) -> None:
    """``trainer=fsdp`` needs a module that shards itself in ``configure_model`` (the BERT recipes' does)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    strategy = cfg.trainer.get("strategy")
    target = strategy.get("_target_", "") if isinstance(strategy, DictConfig) else str(strategy)
    if target.endswith(("ModelParallelStrategy", "FSDP2Strategy")) and not is_overridden("configure_model", model):
        raise RecipeError(
            f"trainer=fsdp: {type(model).__name__} does not shard itself (no configure_model); "
            "the BERT recipes do (experiment=bert_tiny_pydoc, bert_tiny_stdlib, bert_large_pretrain, bert_large_phase2)"
        )


def _report(run_name: str, result: dict[str, Any]) -> None:
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in sorted(result["metrics"].items()) if k.startswith("val/"))
    print(f"\n{run_name}: {metrics or 'no validation metrics'}")
    if "trace_csv" in result:
        unit = result["unit"]
        seen = f"{result['samples_seen']:,} samples"
        if "tokens_seen" in result:
            seen = f"{result['tokens_seen']:,} tokens in {seen}"
        first, last, following = (result[f"{k}_batch_size"] for k in ("first_step", "last_step", "final"))
        print(
            f"SimiGrad batch size ({unit}) moved through {result['min_batch_size']}..{result['max_batch_size']} over"
            f" {result['steps']} steps (B0 = {result['initial_batch_size']}, first step {first}, last step {last};"
            f" the next would be {following}): {seen}"
        )
        print(f"batch-size trace: {result['trace_csv']}\n                  {result['trace_png']}")
    print(f"run directory: {result['output_dir']}")


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    except (RecipeError, InstantiationException) as err:
        # a RecipeError raised in a constructor reaches us wrapped by hydra.utils.instantiate
        cause = err if isinstance(err, RecipeError) else err.__cause__
        if not isinstance(cause, RecipeError):
            raise
        # SystemExit passes through Hydra's job runner, which would otherwise add its own line
        print(f"error: {cause}", file=sys.stderr)
        raise SystemExit(2) from None


def _one_line(err: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages, as one line that says what to fix."""
    cause = err.__cause__
    if isinstance(cause, RecipeError):
        return str(cause)
    text = str(err)
    key = re.match(r"Could not override '([^']+)'", text)
    if key:
        return (
            f"unknown config key '{key.group(1)}': check its spelling "
            "(`simigrad-train --cfg job` prints every key of the composed config)"
        )
    missing_dir = re.match(r"Additional config directory '([^']+)' not found", text)
    if missing_dir:
        return (
            f"--config-dir {missing_dir.group(1)} is not a folder; pass the folder that holds your config groups "
            "(e.g. ./my_conf with ./my_conf/experiment/my_exp.yaml)"
        )
    head, found, rest = text.partition("Available options")
    message = " ".join(line.strip() for line in head.splitlines() if line.strip())
    if found:  # "Available options in 'experiment':" then one option per line
        rest = rest.split("Config search path")[0]
        title, *options = [line.strip() for line in rest.splitlines() if line.strip()]
        message += f". Available options {title} {', '.join(options)}"
    return message


def main() -> None:
    """Console entry ``simigrad-train``: run Hydra, turn user errors into one line and exit code 2."""
    # Let Hydra's errors reach us instead of being printed as a trimmed traceback with exit code 1.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        _hydra_main()
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except (HydraException, OmegaConfBaseException) as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

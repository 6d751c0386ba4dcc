"""``LightningCLI`` configures SimiGrad as a callback, from YAML and from the command line."""

from __future__ import annotations

from lightning_simigrad import SimiGrad
from tests.support.user_modules import ImagesDataModule, LitClassifier


def test_lightning_cli_configures_simigrad_from_yaml_and_the_command_line(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "simigrad.yaml"
    config.write_text(
        "trainer:\n"
        "  max_epochs: 2\n  logger: false\n  enable_checkpointing: false\n  enable_progress_bar: false\n"
        "  accelerator: cpu\n  devices: 1\n"
        "  callbacks:\n"
        "    - class_path: lightning_simigrad.SimiGrad\n"
        "      init_args:\n        target_similarity: 0.9\n        max_batch_size: 64\n"
    )
    cli = LightningCLI(
        LitClassifier,
        ImagesDataModule,
        args=[
            "fit",
            "--config",
            str(config),
            "--trainer.callbacks.init_args.target_similarity=0.95",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        seed_everything_default=0,
    )
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, SimiGrad)]
    assert cb.target_similarity == 0.95 and cb.controller.max_batch_size == 64
    assert cb.samples_seen == 2 * len(cli.datamodule.train_set)
    assert max(h["batch_size"] for h in cb.history) > 16

    cli = LightningCLI(
        LitClassifier,
        ImagesDataModule,
        args=[
            "fit",
            "--trainer.max_epochs=1",
            "--trainer.logger=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.callbacks+=lightning_simigrad.SimiGrad",
            "--trainer.callbacks.target_similarity=0.8",
            "--trainer.callbacks.max_samples=100",
            f"--trainer.default_root_dir={tmp_path / 'second'}",
        ],
        seed_everything_default=0,
    )
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, SimiGrad)]
    assert cb.target_similarity == 0.8 and cb.samples_seen == 100

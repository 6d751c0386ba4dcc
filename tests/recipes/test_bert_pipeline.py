"""The paper's BERT pipeline: phase 2 (sequence length 512) continuing phase 1's weights, and the smoke chain
phase 1 -> phase 2 -> SQuAD run end to end as docs/recipes.md gives it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_simigrad_recipes.errors import RecipeError
from lightning_simigrad_recipes.models.masked_lm import MaskedLM
from lightning_simigrad_recipes.models.pretrained import load_pretrained
from lightning_simigrad_recipes.models.question_answering import QuestionAnswering
from lightning_simigrad_recipes.train import CONFIG_MODULE, train

TINY_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
# the stdlib corpus of the smoke chain: the email package's sources, read where this interpreter keeps them
STDLIB = ["data.source=stdlib", "data.files='email/**/*.py'"]


def compose_cfg(overrides: list[str]) -> DictConfig:
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_phase2_has_the_papers_settings_and_phase1s_model() -> None:
    phase1, phase2 = compose_cfg(["experiment=bert_large_pretrain"]), compose_cfg(["experiment=bert_large_phase2"])
    assert phase2.data.max_seq_length == 512 and phase1.data.max_seq_length == 128
    assert phase2.simigrad.initial_batch_size == 32768 and phase2.optimizer.lr == pytest.approx(2e-3)
    assert phase2.optimizer._target_ == "pytorch_optimizer.Lamb" and phase2.trainer.gradient_clip_val == 1.0
    assert phase2.scheduler.warmup_fraction == pytest.approx(0.02) and phase2.trainer.max_epochs == 20
    assert phase2.model.config == phase1.model.config  # the checkpoint's sizes, room for 512 positions
    assert phase2.model.config.max_position_embeddings == 512
    assert phase2.smoke.model.config == phase1.smoke.model.config
    assert OmegaConf.is_missing(phase2.model, "init_from") and OmegaConf.is_missing(phase2.tokenizer, "path")
    assert compose_cfg(["experiment=bert_large_phase2", "simigrad=off"]).simigrad.adjust is False


def test_phase2_without_its_checkpoint_stops_in_one_line_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_simigrad_recipes.train import main

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # main() sets it; keep it from leaking into other tests
    argv = ["experiment=bert_large_phase2", "debug=smoke", "data.files=/nowhere/*.txt", "logger=none"]
    argv += [f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    monkeypatch.setattr("sys.argv", ["simigrad-train", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    # named before data.files, which is read first once the run starts
    assert lines[0] == (
        "error: model.init_from, tokenizer.path are not set and experiment=bert_large_phase2 needs them: add"
        " model.init_from=... tokenizer.path=... to the command (conf/experiment/bert_large_phase2.yaml says what"
        " each takes)"
    )


def test_phase2_starts_from_the_weights_a_phase1_smoke_run_saved(tmp_path: Path) -> None:
    phase1 = tmp_path / "phase1"
    train(
        compose_cfg(
            [
                "experiment=bert_large_pretrain",
                "debug=smoke",
                *STDLIB,
                "tokenizer.train=true",
                "tokenizer.vocab_size=500",
                "trainer.enable_checkpointing=true",
                f"output_dir={phase1}",
                "logger=none",
                "num_threads=2",
            ]
        )  # fmt: skip
    )
    (checkpoint,) = phase1.glob("checkpoints/*.ckpt")
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    cfg = compose_cfg([
        "experiment=bert_large_phase2", "debug=smoke", *STDLIB, f"tokenizer.path={phase1 / 'tokenizer'}",
        f"model.init_from='{checkpoint}'", f"output_dir={tmp_path / 'phase2'}", "logger=none",
    ])  # fmt: skip
    smoke = OmegaConf.merge(cfg, cfg.smoke)  # what train() builds under debug=smoke
    dm = instantiate(smoke.data)
    dm.output_dir = tmp_path / "phase2"
    model = instantiate(smoke.model, optimizer=None, **dm.model_kwargs())
    assert dm.max_seq_length == 64  # phase 1's smoke length doubled, as 128 -> 512
    phase2 = model.bert.state_dict()  # BertForMaskedLM: the encoder (bert.*) and the masked-LM head (cls.*)
    assert {key.split(".")[0] for key in phase2} == {"bert", "cls"}
    for key, value in phase2.items():
        assert torch.equal(value, saved[f"bert.{key}"]), key
    assert model.init_report["fresh"] == [] and model.init_report["dropped"] == []
    assert len(model.init_report["loaded"]) == len(saved)


def test_a_checkpoint_that_cannot_continue_phase2_is_refused(tmp_path: Path) -> None:
    adamw = lambda params: torch.optim.AdamW(params)  # noqa: E731
    config = dict(TINY_BERT, max_position_embeddings=64)
    qa = tmp_path / "qa.ckpt"  # a fine-tuned model's weights: an encoder, but no masked-LM head
    torch.save({"state_dict": QuestionAnswering(config, 50, 0, adamw).state_dict()}, qa)
    with pytest.raises(RecipeError, match=r"model.init_from=.*qa.ckpt holds no bert.cls.\* tensors"):
        MaskedLM(config, 50, 0, adamw, init_from=str(qa))
    # ... whereas SQuAD takes its encoder, through the same loader
    assert load_pretrained(QuestionAnswering(config, 50, 0, adamw).bert, str(qa))["fresh"] == [
        "qa_outputs.bias",
        "qa_outputs.weight",
    ]
    mlm = tmp_path / "mlm.pt"  # a BertForMaskedLM state dict saved by itself
    torch.save(MaskedLM(config, 50, 0, adamw).bert.state_dict(), mlm)
    assert MaskedLM(config, 50, 0, adamw, init_from=str(mlm)).init_report["fresh"] == []
    with pytest.raises(RecipeError, match=r"its BERT does not match .*cls.predictions.bias: checkpoint \(50,\)"):
        MaskedLM(config, 60, 0, adamw, init_from=str(mlm))
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(RecipeError, match=r"junk.ckpt could not be read as a PyTorch checkpoint"):
        MaskedLM(config, 50, 0, adamw, init_from=str(tmp_path / "junk.ckpt"))
    # 512 tokens on a model of 64 positions: refused before the first forward pass
    with pytest.raises(RecipeError, match=r"data.max_seq_length=512 exceeds model.config.max_position_embeddings=64"):
        MaskedLM(config, 50, 0, adamw, max_seq_length=512)


def _run(args: list[str], cwd: Path) -> str:
    """``simigrad-train ARGS`` as a user types it (the module behind the console script), its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_simigrad_recipes.train", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_smoke_chain_of_docs_recipes_md_runs_end_to_end(tmp_path: Path) -> None:
    """Phase 1 -> phase 2 -> SQuAD on CPU: a tiny BERT, the stdlib corpus, a generated SQuAD pair (~1 min)."""
    generate = [sys.executable, "-m", "lightning_simigrad_recipes.data.squad_synthetic", "squad"]
    subprocess.run(generate, cwd=tmp_path, check=True)
    common = ["debug=smoke", "logger=none", "num_threads=2"]
    _run(["experiment=bert_large_pretrain", *common, *STDLIB, "tokenizer.train=true", "tokenizer.vocab_size=2000",
          "trainer.enable_checkpointing=true", "output_dir=runs/phase1"], tmp_path)  # fmt: skip
    (phase1,) = (tmp_path / "runs/phase1/checkpoints").glob("*.ckpt")
    out = _run(["experiment=bert_large_phase2", *common, *STDLIB, "tokenizer.path=runs/phase1/tokenizer",
                f"model.init_from='{phase1.relative_to(tmp_path)}'", "trainer.enable_checkpointing=true",
                "output_dir=runs/phase2"], tmp_path)  # fmt: skip
    assert re.search(r"model.init_from=runs/phase1/\S+: loaded \d+ tensors into bert.\*, cls.\*; initialised fresh:"
                     r" nothing; dropped 0 tensors", out), out[-3000:]  # fmt: skip
    assert "bert_large_phase2-paper-seed0: val/loss" in out
    (phase2,) = (tmp_path / "runs/phase2/checkpoints").glob("*.ckpt")
    out = _run(["experiment=squad_finetune", *common, "data.train_file=squad/train-v1.1.json",
                "data.dev_file=squad/dev-v1.1.json", "tokenizer.path=runs/phase1/tokenizer",
                f"model.init_from='{phase2.relative_to(tmp_path)}'", "output_dir=runs/squad"], tmp_path)  # fmt: skip
    assert re.search(r"model.init_from=runs/phase2/\S+: loaded \d+ tensors into bert.\*; initialised fresh:"
                     r" qa_outputs.bias, qa_outputs.weight", out), out[-3000:]  # fmt: skip
    scores = re.search(r"SQuAD v1.1 dev: exact match (\d+\.\d\d), F1 (\d+\.\d\d)\n", out)
    assert scores is not None, out[-3000:]
    assert 0.0 <= float(scores[1]) <= float(scores[2]) <= 100.0
    summary = next(line for line in out.splitlines() if line.startswith("squad_finetune-paper-seed0:"))
    assert "val/exact_match" in summary and "val/f1" in summary
    print(f"\nsmoke chain: {scores[0].strip()}\n{summary}")


def test_phase2_continues_from_phase1s_token_shards(tmp_path: Path) -> None:
    # the corpus prepared once on disk serves both phases: phase 1 at its length, phase 2 at the longer one
    from lightning_simigrad_recipes.data.prepare_text import main as prepare

    shards = tmp_path / "shards"
    prepare(["--source", "pydoc", "--vocab-size", "500", "--val-fraction", "0.1", "--workers", "1",
             "--out", str(shards)])  # fmt: skip
    phase1 = tmp_path / "phase1"
    common = ["debug=smoke", "data=text_shards", f"data.path={shards}", "logger=none", "num_threads=2"]
    train(compose_cfg(["experiment=bert_large_pretrain", *common, "trainer.enable_checkpointing=true",
                       f"output_dir={phase1}"]))  # fmt: skip
    (checkpoint,) = phase1.glob("checkpoints/*.ckpt")
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    cfg = compose_cfg(["experiment=bert_large_phase2", *common, f"tokenizer.path={shards / 'tokenizer'}",
                       f"model.init_from='{checkpoint}'", f"output_dir={tmp_path / 'phase2'}"])  # fmt: skip
    result = train(cfg)
    assert result["steps"] > 0 and result["metrics"]["val/loss"] > 0
    smoke = OmegaConf.merge(cfg, cfg.smoke)
    dm = instantiate(smoke.data)
    model = instantiate(smoke.model, optimizer=None, **dm.model_kwargs())
    assert dm.max_seq_length == 64 and model.init_report["fresh"] == []  # the longer length, phase 1's weights
    for key, value in model.bert.state_dict().items():
        assert torch.equal(value, saved[f"bert.{key}"]), key

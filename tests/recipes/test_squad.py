"""SQuAD v1.1 fine-tuning: the official scoring, the feature windows against their offsets, a smoke fine-tune.

The SQuAD files are written here in tmp_path in the official JSON format (``recipes/data/squad_synthetic.py``):
articles whose paragraphs are long enough to be cut into several windows, questions whose answers sit at known
character offsets (some next to punctuation, one at a context's very end), dev questions with several gold answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_simigrad_recipes.data.squad import SquadDataModule, prepare_features, read_squad
from lightning_simigrad_recipes.data.squad_eval import (
    evaluate,
    exact_match_score,
    f1_score,
    metric_max_over_ground_truths,
    normalize_answer,
    postprocess_predictions,
)
from lightning_simigrad_recipes.data.squad_synthetic import make_squad
from lightning_simigrad_recipes.errors import RecipeError
from lightning_simigrad_recipes.models.masked_lm import MaskedLM
from lightning_simigrad_recipes.models.question_answering import QuestionAnswering
from lightning_simigrad_recipes.train import CONFIG_MODULE, train

TINY_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def squad_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("squad")
    files = make_squad(folder / "train-v1.1.json", seed=0), make_squad(folder / "dev-v1.1.json", seed=1)
    for file in files:  # the generated offsets are what they claim to be
        for article in json.loads(file.read_text())["data"]:
            for paragraph in article["paragraphs"]:
                for qa in paragraph["qas"]:
                    for answer in qa["answers"]:
                        assert paragraph["context"][answer["answer_start"] :].startswith(answer["text"])
    return files


def datamodule(train_file: Path, dev_file: Path, out: Path, **kwargs) -> SquadDataModule:
    args = dict(
        tokenizer=dict(train=True, vocab_size=300, lowercase=True),
        max_seq_length=48,
        doc_stride=12,
        max_query_length=16,
        batch_size=4,
    )
    dm = SquadDataModule(train_file=str(train_file), dev_file=str(dev_file), **(args | kwargs))
    dm.output_dir = out
    dm.check_inputs()
    return dm


# ---- the official scoring, by hand
def test_normalisation_drops_case_punctuation_articles_and_extra_whitespace() -> None:
    assert normalize_answer("The  Quick, brown FOX!") == "quick brown fox"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("the theater") == "theater"  # articles as whole words only
    assert normalize_answer("  Denver\tBroncos\n") == "denver broncos"
    assert normalize_answer("U.S.-based") == "usbased"  # punctuation removed, not replaced by a space
    assert normalize_answer("(a)") == ""  # punctuation goes first, then the article
    assert exact_match_score("the Eiffel Tower.", "Eiffel tower") == 1.0
    assert exact_match_score("Eiffel", "Eiffel Tower") == 0.0


def test_f1_is_the_token_overlap_and_a_question_scores_its_best_gold_answer() -> None:
    # "in the year 1850" -> [in, year, 1850], "1850" -> [1850]: 1 common token,
    # precision 1/3, recall 1/1, F1 = 2 (1/3)(1) / (1/3 + 1) = (2/3) / (4/3) = 0.5
    assert f1_score("in the year 1850", "1850") == pytest.approx(0.5)
    # "the big red barn" -> [big, red, barn], "red barn door" -> [red, barn, door]: 2 common,
    # precision 2/3, recall 2/3, F1 = 2/3
    assert f1_score("the big red barn", "red barn door") == pytest.approx(2 / 3)
    # counts are clipped: "go go go" -> 3 tokens, "go" -> 1, 1 common: precision 1/3, recall 1, F1 = 0.5
    assert f1_score("go go go", "go") == pytest.approx(0.5)
    assert f1_score("nothing shared", "else entirely") == 0.0
    gold = ["Broncos", "Denver Broncos", "the Denver Broncos team"]
    assert metric_max_over_ground_truths(exact_match_score, "denver broncos", gold) == 1.0
    # against "Broncos": 1 common of 1 predicted and 1 gold -> F1 1: the best of the three
    assert metric_max_over_ground_truths(f1_score, "Broncos", gold) == 1.0
    # "Denver" against "Denver Broncos" (P 1, R 1/2: F1 2/3) and "the Denver Broncos team" (P 1, R 1/3: F1 1/2)
    assert metric_max_over_ground_truths(f1_score, "Denver", gold) == pytest.approx(2 / 3)


def test_evaluate_averages_over_every_question_and_scores_an_unanswered_one_zero() -> None:
    dataset = [
        {
            "paragraphs": [
                {
                    "context": "...",
                    "qas": [
                        {"id": "q1", "answers": [{"text": "Denver Broncos"}, {"text": "Broncos"}]},
                        {"id": "q2", "answers": [{"text": "1850"}]},
                        {"id": "q3", "answers": [{"text": "Paris"}]},
                    ],
                }
            ]
        }
    ]
    # q1: exact (EM 1, F1 1); q2: "in the year 1850" (EM 0, F1 0.5); q3: unanswered (0, 0)
    scores = evaluate(dataset, {"q1": "the Broncos", "q2": "in the year 1850"})
    assert scores["exact_match"] == pytest.approx(100 / 3)
    assert scores["f1"] == pytest.approx(150 / 3)


def test_postprocessing_picks_the_best_valid_span_and_maps_it_back_by_the_offsets() -> None:
    context = "Paris is the capital of France."
    # [CLS] where ? [SEP] paris is the capital of france . [SEP] [PAD]
    offsets = np.array(
        [[-1, -1]] * 4 + [[0, 5], [6, 8], [9, 12], [13, 20], [21, 23], [24, 30], [30, 31]] + [[-1, -1]] * 2
    )
    start, end = np.zeros((1, 13)), np.zeros((1, 13))
    start[0, 1] = end[0, 1] = 9.0  # in the question: outside the context, never an answer
    start[0, 9], end[0, 9] = 3.0, 2.5  # "France": 5.5, the best valid span
    start[0, 10], end[0, 4] = 4.0, 4.0  # "." to "Paris" would score 8, but ends before it starts
    end[0, 10] = 1.0  # "." scores 4 + 1 = 5, "France." 3 + 1 = 4, "Paris" 0 + 4 = 4
    args = ([context], ["q"], np.array([0]), offsets[None])
    assert postprocess_predictions(*args, start, end) == {"q": "France"}
    start[0, 5] = 3.5  # "is the capital of France" (5 tokens): 3.5 + 2.5 = 6.0 ...
    assert postprocess_predictions(*args, start, end) == {"q": "is the capital of France"}
    # ... unless answers are at most 2 tokens long
    assert postprocess_predictions(*args, start, end, max_answer_length=2) == {"q": "France"}
    # no valid span at all (every candidate outside the context): an empty answer
    assert postprocess_predictions(*args, start, end, n_best_size=1) == {"q": ""}


# ---- the feature windows
def test_windows_label_each_answer_by_its_tokens_or_cls(squad_files: tuple[Path, Path], tmp_path: Path) -> None:
    train_file, dev_file = squad_files
    dm = datamodule(train_file, dev_file, tmp_path)
    _, examples = read_squad(str(train_file))
    max_seq_length, doc_stride = 48, 12
    features = prepare_features(examples, dm.tokenizer, max_seq_length, doc_stride, 16, keep_offsets=True)
    assert len(features) > 3 * len(examples)  # long contexts: several windows per question
    cls_id = dm.tokenizer.cls_token_id
    inside_counts = np.zeros(len(examples), dtype=int)
    for i in range(len(features)):
        example = examples[features.example_index[i]]
        offsets = features.offset_mapping(i)
        context_tokens = [j for j, o in enumerate(offsets) if o is not None]
        first, last = offsets[context_tokens[0]], offsets[context_tokens[-1]]
        start_char = example.answer_starts[0]
        end_char = start_char + len(example.answers[0])
        inside = first[0] <= start_char and last[1] >= end_char
        start, end = int(features.start_positions[i]), int(features.end_positions[i])
        if inside:
            inside_counts[features.example_index[i]] += 1
            assert start in context_tokens and end in context_tokens and start <= end
            text = example.context[offsets[start][0] : offsets[end][1]]
            assert text == example.answers[0], (i, text, example.answers[0])
        else:
            assert start == end == 0 and features.input_ids[i, 0] == cls_id
    assert (inside_counts >= 1).all()  # every answer lies wholly inside at least one window ...
    assert (features.start_positions == 0).sum() > len(features) // 2  # ... and most windows hold none (CLS)
    # the windows of one question overlap by doc_stride context tokens, as the tokenizer's stride makes them
    rows = np.flatnonzero(features.example_index == 0)
    assert len(rows) >= 3
    for a, b in zip(rows[:-1], rows[1:]):
        ids_a = features.input_ids[a][features.offsets[a, :, 0] >= 0]
        ids_b = features.input_ids[b][features.offsets[b, :, 0] >= 0]
        assert np.array_equal(ids_a[-doc_stride:], ids_b[:doc_stride])


def test_every_gold_answer_inside_a_dev_window_maps_back_to_its_text(
    squad_files: tuple[Path, Path], tmp_path: Path
) -> None:
    """All gold answers (the dev questions have up to four), found in each window by a plain scan of the offsets."""
    dm = datamodule(*squad_files, tmp_path)
    features, examples = dm.eval_features, dm.eval_examples
    found = 0
    for i in range(len(features)):
        example = examples[features.example_index[i]]
        context = [(j, o) for j, o in enumerate(features.offset_mapping(i)) if o is not None]
        for text, start_char in zip(example.answers, example.answer_starts):
            end_char = start_char + len(text)
            if not (context[0][1][0] <= start_char and end_char <= context[-1][1][1]):
                continue  # not wholly inside this window
            start = max(j for j, (s, _) in context if s <= start_char)
            end = min(j for j, (_, e) in context if e >= end_char)
            offsets = dict(context)
            assert example.context[offsets[start][0] : offsets[end][1]] == text, (i, text)
            found += 1
    assert found > 2 * len(examples)  # several answers per question, some in two windows


def test_perfect_logits_score_100_and_partial_validation_scores_whole_questions(
    squad_files: tuple[Path, Path], tmp_path: Path
) -> None:
    dm = datamodule(*squad_files, tmp_path)
    features = dm.eval_features
    n = len(features)
    start = np.zeros((n, features.input_ids.shape[1]), dtype=np.float32)
    end = np.zeros_like(start)
    start[np.arange(n), features.start_positions] = 1.0  # one-hot at the gold tokens (CLS where not inside)
    end[np.arange(n), features.end_positions] = 1.0
    scores = dm.evaluate(np.arange(n), start, end)
    assert scores["exact_match"] == scores["f1"] == 100.0
    assert scores["questions"] == scores["total_questions"] == len(dm.eval_examples)
    # DDP's sampler repeats rows to even out the ranks: counted once
    doubled = np.concatenate([np.arange(n), np.arange(5)])
    assert dm.evaluate(doubled, start[doubled], end[doubled])["exact_match"] == 100.0
    # with a part of the windows (trainer.limit_val_batches), only the questions seen whole are scored
    part = np.arange(n // 2)
    scores = dm.evaluate(part, start[part], end[part])
    assert 0 < scores["questions"] < scores["total_questions"] and scores["exact_match"] == 100.0
    # the wrong answer everywhere: one-hot at the context's first token of each window
    wrong_start = np.zeros_like(start)
    first_context = (features.offsets[:, :, 0] >= 0).argmax(axis=1)
    wrong_start[np.arange(n), first_context] = 1.0
    assert dm.evaluate(np.arange(n), wrong_start, wrong_start)["exact_match"] < 50.0


def test_missing_and_malformed_files_are_clear_errors(squad_files: tuple[Path, Path], tmp_path: Path) -> None:
    train_file, dev_file = squad_files
    with pytest.raises(RecipeError, match=r"data.dev_file is not set: give the SQuAD v1.1 JSON files"):
        SquadDataModule(train_file=str(train_file), dev_file=None).check_inputs()
    with pytest.raises(RecipeError, match=r"data.train_file=.*nope.json does not exist"):
        SquadDataModule(train_file=str(tmp_path / "nope.json"), dev_file=str(dev_file)).check_inputs()
    (tmp_path / "bad.json").write_text('{"data": [{"title": "x", "paras": []}]}')
    with pytest.raises(RecipeError, match=r"not in SQuAD v1.1's format \(KeyError: 'paragraphs'\)"):
        read_squad(str(tmp_path / "bad.json"), "data.dev_file")
    (tmp_path / "v2.json").write_text('{"version": "v2.0", "data": []}')
    with pytest.raises(RecipeError, match="SQuAD v2.0"):
        read_squad(str(tmp_path / "v2.json"))
    with pytest.raises(RecipeError, match="doc_stride=40 must be less than"):
        datamodule(train_file, dev_file, tmp_path, doc_stride=40)
    with pytest.raises(RecipeError, match=r"data.max_train_examples=0: give at least 1 or null for every question"):
        SquadDataModule(train_file=str(train_file), dev_file=str(dev_file), max_train_examples=0)


# ---- the recipe, end to end
def compose_cfg(overrides: list[str]) -> DictConfig:
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def test_the_paper_settings_are_the_defaults() -> None:
    cfg = compose_cfg(["experiment=squad_finetune"])
    assert (cfg.data.max_seq_length, cfg.data.doc_stride, cfg.data.max_query_length) == (384, 128, 64)
    assert cfg.optimizer.lr == pytest.approx(3e-5) and cfg.trainer.max_epochs == 2
    assert cfg.simigrad.initial_batch_size == 24 and cfg.scheduler.warmup_fraction == pytest.approx(0.1)
    assert cfg.model.config.hidden_size == 1024 and cfg.model.config.num_hidden_layers == 24
    assert (
        cfg.simigrad.adjust is True
        and compose_cfg(["experiment=squad_finetune", "simigrad=off"]).simigrad.adjust is False
    )


def test_smoke_fine_tune_reports_exact_match_and_f1(
    squad_files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train_file, dev_file = squad_files
    cfg = compose_cfg([
        "experiment=squad_finetune", "debug=smoke", f"data.train_file={train_file}", f"data.dev_file={dev_file}",
        f"output_dir={tmp_path}", "logger=none", "num_threads=2",
    ])  # fmt: skip
    result = train(cfg)
    printed = capsys.readouterr().out
    metrics = result["metrics"]
    with capsys.disabled():
        print(f"\nsmoke fine-tune: EM {metrics['val/exact_match']:.2f}, F1 {metrics['val/f1']:.2f}")
    assert 0.0 <= metrics["val/exact_match"] <= metrics["val/f1"] <= 100.0
    assert np.isfinite(metrics["val/loss"]) and result["steps"] >= 4
    assert Path(result["trace_csv"]).is_file() and (tmp_path / "tokenizer" / "vocab.txt").is_file()
    assert "SQuAD v1.1 dev: exact match" in printed and "val/exact_match" in printed and "val/f1" in printed


def test_missing_squad_paths_stop_the_recipe_with_an_error(tmp_path: Path) -> None:
    cfg = compose_cfg(["experiment=squad_finetune", "debug=smoke", f"output_dir={tmp_path}", "logger=none"])
    with pytest.raises(RecipeError, match="data.train_file is not set"):
        train(cfg)


# ---- initialising from a masked-LM pretraining checkpoint
def pretraining_checkpoint(path: Path, vocab_size: int, config: dict) -> tuple[Path, MaskedLM]:
    """One optimizer step of the masked-LM recipe's module under a Lightning Trainer, saved as Lightning saves it."""
    torch.manual_seed(0)
    module = MaskedLM(config, vocab_size, 0, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    ids = torch.randint(5, vocab_size, (8, 16))
    labels = torch.where(torch.rand(8, 16) < 0.3, ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]
    samples = [{"input_ids": ids[i], "labels": labels[i]} for i in range(8)]
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(path.parent),
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(samples, batch_size=4))
    trainer.save_checkpoint(path)
    return path, module


def test_init_from_a_pretraining_checkpoint_loads_its_encoder(tmp_path: Path) -> None:
    config = dict(TINY_BERT, max_position_embeddings=64)
    ckpt, pretrained = pretraining_checkpoint(tmp_path / "mlm.ckpt", 50, config)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    adamw = lambda params: torch.optim.AdamW(params)  # noqa: E731
    torch.manual_seed(1)
    fresh = QuestionAnswering(config, 50, 0, adamw)
    torch.manual_seed(1)
    model = QuestionAnswering(config, 50, 0, adamw, init_from=str(ckpt))
    encoder = model.bert.bert.state_dict()
    assert len(encoder) == len(model.init_report["loaded"]) > 30
    for key, value in encoder.items():
        assert torch.equal(value, saved[f"bert.bert.{key}"]), key
        assert torch.equal(value, pretrained.bert.bert.state_dict()[key]), key
    assert model.init_report["fresh"] == ["qa_outputs.bias", "qa_outputs.weight"]  # of BertForQuestionAnswering
    assert torch.equal(model.bert.qa_outputs.weight, fresh.bert.qa_outputs.weight)  # the fresh init, untouched
    assert model.init_report["dropped"] and all(k.startswith("bert.cls.") for k in model.init_report["dropped"])
    # a wider model, or another vocabulary, is refused with the file and the fix named
    with pytest.raises(RecipeError, match=r"mlm.ckpt: its BERT does not match.*hidden_size 32.*tokenizer.path"):
        QuestionAnswering(dict(config, hidden_size=64), 50, 0, adamw, init_from=str(ckpt))
    with pytest.raises(RecipeError, match=r"vocab_size 50.*vocab_size 60"):
        QuestionAnswering(config, 60, 0, adamw, init_from=str(ckpt))
    with pytest.raises(RecipeError, match=r"model.init_from=.*missing.ckpt does not exist"):
        QuestionAnswering(config, 50, 0, adamw, init_from=str(tmp_path / "missing.ckpt"))


def test_a_pretraining_run_of_the_recipes_starts_the_fine_tune(squad_files: tuple[Path, Path], tmp_path: Path) -> None:
    """experiment=bert_large_pretrain debug=smoke, then squad_finetune debug=smoke from its checkpoint and tokenizer."""
    train_file, dev_file = squad_files
    corpus = tmp_path / "corpus.txt"
    _, examples = read_squad(str(train_file))
    corpus.write_text("\n".join(dict.fromkeys(ex.context for ex in examples)), encoding="utf-8")
    pretrain = tmp_path / "pretrain"
    cfg = compose_cfg([
        "experiment=bert_large_pretrain", "debug=smoke", f"data.files={corpus}", "tokenizer.train=true",
        "tokenizer.vocab_size=300", "trainer.enable_checkpointing=true", f"output_dir={pretrain}", "logger=none",
        "num_threads=2",
    ])  # fmt: skip
    train(cfg)
    (checkpoint,) = pretrain.glob("checkpoints/*.ckpt")  # a Lightning checkpoint of a Hydra run: omegaconf inside
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    cfg = compose_cfg([
        "experiment=squad_finetune", "debug=smoke", f"data.train_file={train_file}", f"data.dev_file={dev_file}",
        f"tokenizer.path={pretrain / 'tokenizer'}", f"model.init_from='{checkpoint}'",
        f"output_dir={tmp_path / 'finetune'}", "logger=none", "num_threads=2",
    ])  # fmt: skip
    smoke = OmegaConf.merge(cfg, cfg.smoke)  # what train() builds under debug=smoke
    dm = instantiate(smoke.data)
    dm.output_dir = tmp_path / "finetune"
    model = instantiate(smoke.model, optimizer=None, **dm.model_kwargs())
    for key, value in model.bert.bert.state_dict().items():
        assert torch.equal(value, saved[f"bert.bert.{key}"]), key
    result = train(cfg)
    assert {"val/exact_match", "val/f1"} <= set(result["metrics"])


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.init_from={tmp}/missing.ckpt", "model.init_from={tmp}/missing.ckpt does not exist"),  # in the model
        ("smoke.data.doc_stride=60", "data.doc_stride=60 must be less than"),  # in the data
        ("data.dev_file={tmp}/missing.json", "data.dev_file={tmp}/missing.json does not exist"),
        ("data.train_file={tmp}/bad.json", "data.train_file={tmp}/bad.json is not in SQuAD v1.1's format (KeyError"),
    ],
)
def test_main_reports_a_bad_setting_in_one_line_and_exit_2(
    override: str,
    expected: str,
    squad_files: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lightning_simigrad_recipes.train import main

    train_file, dev_file = squad_files
    (tmp_path / "bad.json").write_text('{"version": "1.1", "data": [{"title": "no paragraphs"}]}')
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # main() sets it; keep it from leaking into other tests
    argv = ["experiment=squad_finetune", "debug=smoke", f"data.train_file={train_file}", f"data.dev_file={dev_file}"]
    argv += [override.format(tmp=tmp_path), "logger=none", f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    monkeypatch.setattr("sys.argv", ["simigrad-train", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and expected.format(tmp=tmp_path) in lines[0]


@pytest.mark.timeout(300)
def test_smoke_fine_tune_under_ddp_scores_every_question_once(squad_files: tuple[Path, Path], tmp_path: Path) -> None:
    """Two CPU processes (Lightning starts the second): each scores its share of the dev windows, gathered."""
    train_file, dev_file = squad_files
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env.update(OMP_NUM_THREADS="1")
    argv = [
        "experiment=squad_finetune", "debug=smoke", "+smoke.trainer.devices=2", "+smoke.trainer.strategy=ddp",
        f"data.train_file={train_file}", f"data.dev_file={dev_file}", "logger=none", "num_threads=1",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_simigrad_recipes.train", *argv, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Starting with 2 processes" in proc.stdout + proc.stderr
    scored = [line for line in proc.stdout.splitlines() if line.startswith("SQuAD v1.1 dev: exact match")]
    assert len(scored) == 1 and "dev questions whose windows" not in scored[0]  # rank 0 only; all 64 questions
    assert "val/exact_match" in proc.stdout and "val/f1" in proc.stdout

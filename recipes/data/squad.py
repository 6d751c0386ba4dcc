"""SQuAD v1.1 for extractive question answering: the official JSON files, cut into windows of a BERT tokenizer.

Each question is tokenized with its context as a pair, ``[CLS] question [SEP] context [SEP]``; a context too long
for ``max_seq_length`` is cut into several windows ("features") that overlap by ``doc_stride`` tokens, as Hugging
Face's question-answering example (``run_qa.py``, ``prepare_train_features`` / ``prepare_validation_features``)
does: ``truncation="only_second"``, ``return_overflowing_tokens=True``, ``return_offsets_mapping=True``, padding to
``max_seq_length``. Every window is labelled with the start and end tokens of the (first) gold answer, or with the
``[CLS]`` index when the answer is not wholly inside it. Validation windows also keep their question and the
character offsets of their context tokens, so that ``squad_eval.postprocess_predictions`` can map the model's start
and end logits back to a span of the context, scored by the official SQuAD v1.1 script's rules (``squad_eval``).

Two details differ from ``run_qa.py``, neither changes a label it gets right: questions are cut to
``max_query_length`` tokens first (Google's and the paper's ``run_squad.py`` do; ``run_qa.py`` fails on a question
longer than the window), and the answer's tokens are looked up among the context tokens only (``run_qa.py``'s
forward scan can run past the context into ``[SEP]`` and padding, whose offsets are (0, 0), when the answer starts
at a window's last token).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerFast

from lightning_simigrad_recipes.data.base import TokenizedDataModule
from lightning_simigrad_recipes.data.squad_eval import postprocess_predictions, score
from lightning_simigrad_recipes.data.tokenizer import build_tokenizer
from lightning_simigrad_recipes.errors import RecipeError

FORMAT = (
    '{"version": "1.1", "data": [{"title": ..., "paragraphs": [{"context": ..., "qas": [{"id": ..., '
    '"question": ..., "answers": [{"text": ..., "answer_start": ...}]}]}]}]}'
)
WHERE = "e.g. data.train_file=/data/squad/train-v1.1.json data.dev_file=/data/squad/dev-v1.1.json"


@dataclass(frozen=True)
class SquadExample:
    """One question of a SQuAD file: its context and gold answers (``answer_starts``: character offsets)."""

    id: str
    question: str
    context: str
    answers: tuple[str, ...]
    answer_starts: tuple[int, ...]


def read_squad(path: str | None, key: str = "data.train_file") -> tuple[list[dict[str, Any]], list[SquadExample]]:
    """Read a SQuAD v1.1 JSON file: its ``data`` (the articles, as the official script takes them) and its questions.

    Raises:
        RecipeError: the path is unset or missing, the file is not JSON, not in SQuAD's format, or SQuAD 2.0.
    """
    if not path:
        raise RecipeError(f"{key} is not set: give the SQuAD v1.1 JSON files, {WHERE}")
    file = Path(path).expanduser()
    if not file.is_file():
        raise RecipeError(f"{key}={path} does not exist; give the SQuAD v1.1 JSON files, {WHERE}")
    try:
        dataset = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecipeError(
            f"{key}={path} could not be read as JSON ({err}); expected SQuAD v1.1's format {FORMAT}"
        ) from None
    version = str(dataset.get("version", "")) if isinstance(dataset, dict) else ""
    if version.lstrip("v").startswith("2"):
        raise RecipeError(
            f"{key}={path} is SQuAD {version}, whose unanswerable questions this recipe does not handle; "
            "give SQuAD v1.1's train-v1.1.json and dev-v1.1.json"
        )
    examples: list[SquadExample] = []
    try:
        articles = dataset["data"]
        for a, article in enumerate(articles):
            for p, paragraph in enumerate(article["paragraphs"]):
                context = paragraph["context"]
                for qa in paragraph["qas"]:
                    answers = qa["answers"]
                    if not answers:
                        raise RecipeError(
                            f"{key}={path}: question {qa['id']!r} (data[{a}].paragraphs[{p}]) has no answer; every"
                            " SQuAD v1.1 question has at least one (SQuAD 2.0's unanswerable ones are not supported)"
                        )
                    examples.append(
                        SquadExample(
                            id=str(qa["id"]),
                            question=qa["question"].lstrip(),  # some questions start with spaces (run_qa.py strips)
                            context=context,
                            answers=tuple(answer["text"] for answer in answers),
                            answer_starts=tuple(int(answer["answer_start"]) for answer in answers),
                        )
                    )
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise RecipeError(
            f"{key}={path} is not in SQuAD v1.1's format ({type(err).__name__}: {err}); expected {FORMAT}"
        ) from None
    if not examples:
        raise RecipeError(f"{key}={path} holds no questions; expected SQuAD v1.1's format {FORMAT}")
    return articles, examples


@dataclass
class SquadFeatures:
    """The windows of a list of questions, one row per window, padded to ``max_seq_length``.

    ``start_positions`` / ``end_positions`` are the answer's first and last token in the window, or the
    ``[CLS]`` index when the first gold answer is not wholly inside it. ``example_index`` is the question each window
    belongs to. ``offsets`` holds each context token's ``(start, end)`` characters in the context and ``(-1, -1)``
    for the question, the special tokens and the padding (``run_qa.py`` sets those to ``None``; see
    :meth:`offset_mapping`); ``None`` where they were not kept.
    """

    input_ids: np.ndarray  # [N, L] int32
    token_type_ids: np.ndarray  # [N, L] int8
    attention_mask: np.ndarray  # [N, L] int8
    start_positions: np.ndarray  # [N] int64
    end_positions: np.ndarray  # [N] int64
    example_index: np.ndarray  # [N] int64
    offsets: np.ndarray | None  # [N, L, 2] int32

    def __len__(self) -> int:
        return len(self.input_ids)

    def offset_mapping(self, i: int) -> list[tuple[int, int] | None]:
        """Window ``i``'s offsets as ``run_qa.py`` keeps them: ``(start, end)`` per context token, else ``None``."""
        assert self.offsets is not None, "built with keep_offsets=False"
        return [(int(s), int(e)) if s >= 0 else None for s, e in self.offsets[i]]


def _truncate_questions(
    tokenizer: PreTrainedTokenizerFast, questions: Sequence[str], max_query_length: int
) -> list[str]:
    """Cut each question after its ``max_query_length``-th token (the character where that token ends)."""
    encoded = tokenizer(list(questions), add_special_tokens=False, return_offsets_mapping=True)
    return [
        q if len(ids) <= max_query_length else q[: offsets[max_query_length - 1][1]]
        for q, ids, offsets in zip(questions, encoded["input_ids"], encoded["offset_mapping"])
    ]


def check_tokenizer(tokenizer: PreTrainedTokenizerFast, where: str) -> None:
    """The features need a fast tokenizer that writes ``[CLS] a [SEP] b [SEP]`` and pads on the right."""
    if not getattr(tokenizer, "is_fast", False):
        raise RecipeError(f"the tokenizer at {where} is not a fast tokenizer; the SQuAD windows need its offsets")
    if tokenizer.padding_side != "right":
        raise RecipeError(f"the tokenizer at {where} pads on the {tokenizer.padding_side}; SQuAD needs the right")
    pair = tokenizer("a", "b")
    cls_id = tokenizer.cls_token_id
    if cls_id is None or cls_id not in pair["input_ids"] or 1 not in pair.sequence_ids():
        raise RecipeError(
            f"the tokenizer at {where} does not write [CLS] question [SEP] context [SEP] for a pair (a tokenizer.json"
            " without BERT's post-processor?); give a folder with a BERT WordPiece vocab.txt as tokenizer.path"
        )


def prepare_features(
    examples: Sequence[SquadExample],
    tokenizer: PreTrainedTokenizerFast,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
    keep_offsets: bool = True,
    chunk: int = 1000,
) -> SquadFeatures:
    """Tokenize ``examples`` into windows of ``max_seq_length`` tokens overlapping by ``doc_stride`` context tokens.

    Labels come from each question's first gold answer (SQuAD v1.1's training questions have exactly one); the
    validation questions are labelled the same way, for a validation loss, and scored on all their answers.
    """
    if doc_stride >= max_seq_length - max_query_length - 3:
        raise RecipeError(
            f"data.doc_stride={doc_stride} must be less than the context tokens a window holds,"
            f" max_seq_length - max_query_length - 3 = {max_seq_length - max_query_length - 3}"
            f" (data.max_seq_length={max_seq_length}, data.max_query_length={max_query_length});"
            " lower doc_stride or max_query_length, or raise max_seq_length"
        )
    cls_id = tokenizer.cls_token_id
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("ids", "types", "mask", "start", "end", "example", "off")}
    for first in range(0, len(examples), chunk):
        batch = examples[first : first + chunk]
        questions = _truncate_questions(tokenizer, [ex.question for ex in batch], max_query_length)
        encoded = tokenizer(
            questions,
            [ex.context for ex in batch],
            truncation="only_second",
            max_length=max_seq_length,
            stride=doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            return_token_type_ids=True,
            padding="max_length",
        )
        sample_mapping = encoded["overflow_to_sample_mapping"]
        n = len(encoded["input_ids"])
        ids = np.asarray(encoded["input_ids"], dtype=np.int32)
        offsets = np.asarray(encoded["offset_mapping"], dtype=np.int32)
        starts, ends = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        for i in range(n):
            context = np.fromiter((s == 1 for s in encoded.sequence_ids(i)), dtype=bool, count=max_seq_length)
            offsets[i][~context] = -1
            where_cls = np.flatnonzero(ids[i] == cls_id)
            cls_index = int(where_cls[0]) if len(where_cls) else 0
            example = batch[sample_mapping[i]]
            start_char = example.answer_starts[0]
            end_char = start_char + len(example.answers[0])
            tokens = np.flatnonzero(context)
            token_starts, token_ends = offsets[i, tokens, 0], offsets[i, tokens, 1]
            if len(tokens) and token_starts[0] <= start_char and token_ends[-1] >= end_char:
                # the last context token that starts at or before the answer, the first that ends at or after it
                starts[i] = tokens[np.searchsorted(token_starts, start_char, side="right") - 1]
                ends[i] = tokens[np.searchsorted(token_ends, end_char, side="left")]
            else:
                starts[i] = ends[i] = cls_index
        parts["ids"].append(ids)
        parts["types"].append(np.asarray(encoded["token_type_ids"], dtype=np.int8))
        parts["mask"].append(np.asarray(encoded["attention_mask"], dtype=np.int8))
        parts["start"].append(starts)
        parts["end"].append(ends)
        parts["example"].append(np.asarray(sample_mapping, dtype=np.int64) + first)
        if keep_offsets:
            parts["off"].append(offsets)
    return SquadFeatures(
        input_ids=np.concatenate(parts["ids"]),
        token_type_ids=np.concatenate(parts["types"]),
        attention_mask=np.concatenate(parts["mask"]),
        start_positions=np.concatenate(parts["start"]),
        end_positions=np.concatenate(parts["end"]),
        example_index=np.concatenate(parts["example"]),
        offsets=np.concatenate(parts["off"]) if keep_offsets else None,
    )


class SquadFeatureDataset(Dataset[dict[str, torch.Tensor]]):
    """The windows as a map-style dataset of model inputs and labels (plus ``feature_index`` for validation)."""

    def __init__(self, features: SquadFeatures, with_index: bool = False) -> None:
        self.features, self.with_index = features, with_index

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        f = self.features
        item = {
            "input_ids": torch.from_numpy(f.input_ids[index].astype(np.int64)),
            "token_type_ids": torch.from_numpy(f.token_type_ids[index].astype(np.int64)),
            "attention_mask": torch.from_numpy(f.attention_mask[index].astype(np.int64)),
            "start_positions": torch.tensor(int(f.start_positions[index])),
            "end_positions": torch.tensor(int(f.end_positions[index])),
        }
        if self.with_index:
            item["feature_index"] = torch.tensor(index)
        return item


class SquadDataModule(TokenizedDataModule):
    """SQuAD v1.1: training windows with answer labels, dev windows scored by exact match and F1.

    Args:
        train_file: ``train-v1.1.json`` (required).
        dev_file: ``dev-v1.1.json`` (required).
        tokenizer: the ``tokenizer`` config: ``path`` (a local vocab.txt folder or tokenizer.json, e.g. the one the
            pretraining run used), ``train`` (train WordPiece on the training contexts and questions when no path),
            ``vocab_size``, ``lowercase``.
        max_seq_length: tokens per window, ``[CLS]`` and both ``[SEP]`` included.
        doc_stride: context tokens shared by consecutive windows of one context (Hugging Face's meaning).
        max_query_length: questions are cut to this many tokens.
        max_train_examples: use only the first this many training questions (``None``: all).
        max_eval_examples: use only the first this many dev questions (``None``: all).
        **kwargs: ``batch_size``, ``num_workers``... of :class:`RecipeDataModule`.
    """

    def __init__(
        self,
        train_file: str | None = None,
        dev_file: str | None = None,
        tokenizer: Any = None,
        max_seq_length: int = 384,
        doc_stride: int = 128,
        max_query_length: int = 64,
        max_train_examples: int | None = None,
        max_eval_examples: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        least = [("max_seq_length", max_seq_length, 8), ("doc_stride", doc_stride, 0)]
        least += [("max_query_length", max_query_length, 1), ("max_train_examples", max_train_examples, 1)]
        least += [("max_eval_examples", max_eval_examples, 1)]
        for key, value, smallest in least:
            if value is not None and value < smallest:
                every = " or null for every question" if key.endswith("examples") else ""
                raise RecipeError(f"data.{key}={value}: give at least {smallest}{every} (conf/data/squad.yaml)")
        self.train_file, self.dev_file = train_file, dev_file
        self.tokenizer_cfg = dict(tokenizer or {})
        self.max_seq_length, self.doc_stride, self.max_query_length = max_seq_length, doc_stride, max_query_length
        self.max_train_examples, self.max_eval_examples = max_train_examples, max_eval_examples
        self.output_dir: Path = Path(".")
        self.tokenizer: PreTrainedTokenizerFast | None = None
        self.eval_examples: list[SquadExample] = []
        self.eval_features: SquadFeatures | None = None

    def _build(self) -> None:
        _, train_examples = read_squad(self.train_file, "data.train_file")
        _, eval_examples = read_squad(self.dev_file, "data.dev_file")
        train_examples = train_examples[: self.max_train_examples]
        eval_examples = eval_examples[: self.max_eval_examples]
        cfg = self.tokenizer_cfg
        contexts = list(dict.fromkeys(ex.context for ex in train_examples))  # each paragraph once
        self.tokenizer = build_tokenizer(
            path=cfg.get("path"),
            train=bool(cfg.get("train", False)),
            vocab_size=int(cfg.get("vocab_size", 30522)),
            lowercase=bool(cfg.get("lowercase", True)),
            texts=[*contexts, *(ex.question for ex in train_examples)],  # never the dev questions
            save_dir=self.output_dir / "tokenizer",
        )
        check_tokenizer(self.tokenizer, cfg.get("path") or str(self.output_dir / "tokenizer"))
        window = {
            "max_seq_length": self.max_seq_length,
            "doc_stride": self.doc_stride,
            "max_query_length": self.max_query_length,
        }
        self.train_set = SquadFeatureDataset(
            prepare_features(train_examples, self.tokenizer, **window, keep_offsets=False)
        )
        self.eval_examples = eval_examples
        self.eval_features = prepare_features(eval_examples, self.tokenizer, **window, keep_offsets=True)
        self.val_set = SquadFeatureDataset(self.eval_features, with_index=True)

    def evaluate(
        self,
        feature_index: np.ndarray,
        start_logits: np.ndarray,
        end_logits: np.ndarray,
        n_best_size: int = 20,
        max_answer_length: int = 30,
    ) -> dict[str, float]:
        """Exact match and F1 (x100) of the dev questions all of whose windows have logits.

        ``feature_index[k]`` is the dev window of row ``k`` of the logits; a window given twice (DDP's sampler
        repeats a few to even out the ranks) counts once. With ``trainer.limit_val_batches`` below 1 only the
        questions whose windows were all scored are counted (``questions`` of ``total_questions``).
        """
        assert self.eval_features is not None, "check_inputs() builds the dev windows first"
        features = self.eval_features
        assert features.offsets is not None
        rows, first = np.unique(np.asarray(feature_index, dtype=np.int64), return_index=True)
        n_examples = len(self.eval_examples)
        windows = np.bincount(features.example_index, minlength=n_examples)
        seen = np.bincount(features.example_index[rows], minlength=n_examples)
        complete = np.flatnonzero((seen == windows) & (windows > 0))
        predictions = postprocess_predictions(
            [ex.context for ex in self.eval_examples],
            [ex.id for ex in self.eval_examples],
            features.example_index[rows],
            features.offsets[rows],
            np.asarray(start_logits)[first],
            np.asarray(end_logits)[first],
            n_best_size=n_best_size,
            max_answer_length=max_answer_length,
        )
        gold = {self.eval_examples[i].id: list(self.eval_examples[i].answers) for i in complete}
        scores = score(gold, predictions) if gold else {"exact_match": 0.0, "f1": 0.0}
        return {**scores, "questions": float(len(gold)), "total_questions": float(n_examples)}

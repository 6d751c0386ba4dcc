"""SQuAD v1.1 scoring, as the official ``evaluate-v1.1.py`` computes it, and the post-processing that picks answers.

The official script (Rajpurkar et al., 2016; shipped with the paper's code as
``DeepSpeedExamples/BingBertSquad/evaluate-v1.1.py``) normalises the predicted and the gold answers (lower case, no
punctuation, no articles a/an/the, single spaces), scores a question by its best gold answer under exact match and
under token F1, averages over all questions (an unanswered question scores 0) and reports both x100.

:func:`postprocess_predictions` is Hugging Face's ``postprocess_qa_predictions`` (``utils_qa.py``) for SQuAD v1.1:
over every window of a question, the ``n_best_size`` highest start logits and end logits are paired; a pair is kept
when both tokens lie in the context, end >= start and the span is at most ``max_answer_length`` tokens; the pair of
the highest start + end logit, mapped back to the context's characters by the window's offsets, is the answer.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

_PUNCTUATION = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower case, remove punctuation, remove the articles a/an/the, collapse whitespace (the official order)."""
    text = s.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, ground_truth: str) -> float:
    """Token F1 of the normalised answers: the harmonic mean of token precision and recall (bag of words)."""
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def exact_match_score(prediction: str, ground_truth: str) -> float:
    """1 when the normalised answers are equal, else 0."""
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def metric_max_over_ground_truths(
    metric_fn: Callable[[str, str], float], prediction: str, ground_truths: Iterable[str]
) -> float:
    """A question's score: the best over its gold answers."""
    return max(metric_fn(prediction, ground_truth) for ground_truth in ground_truths)


def score(gold: Mapping[str, Sequence[str]], predictions: Mapping[str, str]) -> dict[str, float]:
    """Exact match and F1 (x100) averaged over the questions of ``gold`` (question id -> its gold answers).

    A question without a prediction scores 0, as in the official script.
    """
    exact_match = f1 = 0.0
    for qid, ground_truths in gold.items():
        if qid not in predictions:
            continue
        exact_match += metric_max_over_ground_truths(exact_match_score, predictions[qid], ground_truths)
        f1 += metric_max_over_ground_truths(f1_score, predictions[qid], ground_truths)
    total = len(gold)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


def evaluate(dataset: Sequence[Mapping[str, Any]], predictions: Mapping[str, str]) -> dict[str, float]:
    """The official ``evaluate(dataset, predictions)``: ``dataset`` is a SQuAD file's ``data`` (its articles)."""
    gold = {
        qa["id"]: [answer["text"] for answer in qa["answers"]]
        for article in dataset
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    }
    return score(gold, predictions)


def postprocess_predictions(
    contexts: Sequence[str],
    example_ids: Sequence[str],
    example_index: np.ndarray,
    offsets: np.ndarray,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    n_best_size: int = 20,
    max_answer_length: int = 30,
) -> dict[str, str]:
    """The best answer text of every question that has at least one window among the rows given.

    Args:
        contexts: each question's context (indexed by ``example_index``).
        example_ids: each question's id.
        example_index: ``[F]``, the question of each window.
        offsets: ``[F, L, 2]``, each window's context-token character spans, ``(-1, -1)`` outside the context.
        start_logits: ``[F, L]``, the model's start logits per window.
        end_logits: ``[F, L]``, its end logits.
        n_best_size: start and end candidates taken per window (the highest logits).
        max_answer_length: the longest answer, in tokens.

    Returns:
        question id -> answer text (``""`` when no window offers a valid span).
    """
    start_logits, end_logits = np.asarray(start_logits), np.asarray(end_logits)
    best: dict[int, tuple[float, int, int]] = {}  # question -> (score, start char, end char)
    for row in range(len(example_index)):
        example = int(example_index[row])
        window_offsets = offsets[row]
        in_context = window_offsets[:, 0] >= 0
        starts, ends = start_logits[row], end_logits[row]
        start_indexes = np.argsort(starts)[-1 : -n_best_size - 1 : -1]
        end_indexes = np.argsort(ends)[-1 : -n_best_size - 1 : -1]
        for start_index in start_indexes:
            if not in_context[start_index]:
                continue
            for end_index in end_indexes:
                if not in_context[end_index] or end_index < start_index:
                    continue
                if end_index - start_index + 1 > max_answer_length:
                    continue
                total = float(starts[start_index]) + float(ends[end_index])
                if example not in best or total > best[example][0]:
                    best[example] = (total, int(window_offsets[start_index, 0]), int(window_offsets[end_index, 1]))
    predictions = {example_ids[int(i)]: "" for i in np.unique(example_index)}
    for example, (_, start_char, end_char) in best.items():
        predictions[example_ids[example]] = contexts[example][start_char:end_char]
    return predictions

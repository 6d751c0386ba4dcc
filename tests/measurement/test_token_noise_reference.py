"""At frozen weights of a tiny causal language model, batches counted in tokens: the logged noise scale times the
step's tokens per sample is the exact effective per-token noise scale B_tok, and the logged similarity is the one
exact per-sequence gradients give (a small piece of ``benchmarks/token_noise_reference.py``).

The truth comes from every sequence's exact gradient (``torch.func``, float64); the logged values from
``SimiGrad(adjust=False, lengths=..., max_micro_batch_tokens=..., loss_items=...)`` training at lr 0 with steps of
512 tokens in micro-batches of at most 256.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("token_noise_reference", REPO / "benchmarks" / "token_noise_reference.py")
assert spec is not None and spec.loader is not None
reference = importlib.util.module_from_spec(spec)
sys.modules["token_noise_reference"] = reference
spec.loader.exec_module(reference)


@pytest.fixture(scope="module")
def frozen():
    torch.manual_seed(0)
    sequences = reference.byte_sequences(300, max_length=48)
    net = reference.trained(sequences, steps=20)
    return net, sequences, reference.exact(net, sequences)


def test_the_truth_is_a_token_noise_scale(frozen):
    _, sequences, truth = frozen
    assert truth.n == 300
    assert truth.mean_length == pytest.approx(sum(len(s) - 1 for s in sequences) / 300)
    # B_tok from the Gram matrix of the same gradients: mean |S_i - n_i G|^2 / (nbar |G|^2)
    n = truth.lengths
    G_sq = float(truth.gram.sum()) / float(n.sum()) ** 2
    cross = truth.gram.sum(1) / float(n.sum())  # S_i . G
    deviations = truth.gram.diagonal() - 2 * n * cross + n**2 * G_sq
    assert G_sq == pytest.approx(truth.grad_sq, rel=1e-9)
    assert float(deviations.mean()) / (truth.mean_length * G_sq) == pytest.approx(truth.token_noise_scale, rel=1e-6)
    assert 50 < truth.token_noise_scale < 1000  # halves of 256 tokens are neither all noise nor all signal


def test_logged_noise_scale_and_similarity_match_the_truth(frozen):
    net, sequences, truth = frozen
    row = reference.measure(net, sequences, truth, tokens=512, steps=120, cap=256, draws=1000)
    b_tok = truth.token_noise_scale
    assert abs(row.logged_noise - b_tok) <= 3 * row.logged_noise_error + 0.05 * b_tok, (row.logged_noise, b_tok)
    assert abs(row.logged_cos - row.exact_cos) <= 3 * math.hypot(row.logged_cos_error, row.exact_cos_error) + 0.01
    # the closed form (a ratio of expectations) is near, not equal: it is what the controller's B* rests on
    assert row.expected_cos == pytest.approx(row.exact_cos, abs=0.05)

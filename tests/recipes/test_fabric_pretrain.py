"""The LitGPT-style Fabric recipe: a smoke run in tokens, then the same command resumed from its checkpoint with a
larger budget continues where it stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_simigrad_recipes.fabric_pretrain import parse, pretrain


@pytest.mark.timeout(600)
def test_the_fabric_recipe_trains_in_tokens_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    common = ["--n-layer", "1", "--n-embd", "32", "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]
    first = pretrain(parse(["--max-tokens", "6000", *common]))
    assert first["first_step"] == 0 and first["steps"] >= 3
    assert 6000 <= first["tokens_seen"] < 6000 + 128  # the budget, to the sample that reaches it
    low, high = first["batch_range"]
    assert low < high  # the batch moved (in tokens)
    more = pretrain(parse(["--max-tokens", "12000", "--resume", first["checkpoint"], *common]))
    assert more["first_step"] == first["steps"]  # continued from the checkpoint's step ...
    assert 12000 <= more["tokens_seen"] < 12000 + 128  # ... and its count

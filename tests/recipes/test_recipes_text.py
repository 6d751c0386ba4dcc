"""The masked-LM text data: the standard-library source, whole-file splits, the token cache, fixed validation masks.

A small "standard library" of generated ``.py`` files is made in tmp_path; every file carries a marker word of
its own, so the token streams can be read back to see which files went where.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lightning_simigrad_recipes.data import text
from lightning_simigrad_recipes.data.text import MaskedTextDataModule, in_validation

WORDS = ["def", "return", "import", "class", "self", "value", "result", "items", "index", "count", "lambda", "yield"]


def make_stdlib(root: Path, files: int = 24) -> Path:
    for i in range(files):
        folder = root / ("pkg" if i % 3 == 0 else "")
        folder.mkdir(parents=True, exist_ok=True)
        body = "\n".join(f"    {WORDS[(i + j) % len(WORDS)]} = marker{i:02d}word + {j}" for j in range(60))
        (folder / f"mod{i:02d}.py").write_text(f"def f{i}():\n{body}\n", encoding="utf-8")
    installed = root / "site-packages" / "thirdparty"
    installed.mkdir(parents=True)
    (installed / "x.py").write_text("installed = thirdpartymarker\n" * 200)
    return root


def module(root: Path, monkeypatch: pytest.MonkeyPatch, **kwargs) -> MaskedTextDataModule:
    monkeypatch.setattr(text, "stdlib_root", lambda: root)
    args = dict(
        source="stdlib",
        files="**/*.py",
        tokenizer=dict(train=True, vocab_size=300, lowercase=False),
        max_seq_length=32,
        split="documents",
        val_fraction=0.3,
        batch_size=4,
    )
    dm = MaskedTextDataModule(**(args | kwargs))
    dm.output_dir = root.parent / "run"
    dm.check_inputs()
    return dm


def markers(dm: MaskedTextDataModule, dataset) -> set[str]:
    """The files whose marker word appears whole in ``dataset`` (a block boundary may cut one)."""
    found = set()
    for i in range(len(dataset)):
        decoded = dm.tokenizer.decode(dataset[i]["input_ids"].tolist(), skip_special_tokens=True)
        found |= set(re.findall(r"marker\d\dword", decoded.replace(" ", "")))  # undo the WordPiece split
    return {w[:8] for w in found}


def test_stdlib_source_splits_whole_files_and_leaves_out_installed_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_stdlib(tmp_path / "lib")
    dm = module(root, monkeypatch, val_mask_seed=None)
    names = [p.relative_to(root).as_posix() for p in sorted(root.rglob("mod*.py"))]
    expected_val = {f"marker{int(n[-5:-3]):02d}" for n in names if in_validation(n, 0.3)}
    assert 0 < len(expected_val) < len(names)
    train_markers, val_markers = markers(dm, dm.train_set), markers(dm, dm.val_set)
    assert val_markers <= expected_val and len(val_markers) >= len(expected_val) - 1  # a tail may be cut off
    assert not train_markers & expected_val  # no file in both splits
    assert len(train_markers) >= len(names) - len(expected_val) - 1
    all_ids = torch.cat([dm.train_set[i]["input_ids"] for i in range(len(dm.train_set))])
    assert "thirdpartymarker" not in dm.tokenizer.decode(all_ids.tolist()).replace(" ", "")


def test_a_files_split_depends_on_its_name_only() -> None:
    names = [f"pkg/mod{i}.py" for i in range(400)]
    chosen = [in_validation(n, 0.1) for n in names]
    assert 20 <= sum(chosen) <= 60  # about 10%
    assert chosen == [in_validation(n, 0.1) for n in names]  # the same on every call, machine and corpus
    assert not any(in_validation(n, 0.0) for n in names)


def test_the_token_cache_is_reused_and_keyed_by_the_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_stdlib(tmp_path / "lib")
    cache = tmp_path / "cache"
    first = module(root, monkeypatch, cache_dir=str(cache))
    (folder,) = cache.iterdir()
    assert (folder / "done").is_file() and (folder / "tokenizer").is_dir()

    def fail(*args, **kwargs):
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(text, "build_tokenizer", fail)
    monkeypatch.setattr(MaskedTextDataModule, "_encode_all", fail)
    again = module(root, monkeypatch, cache_dir=str(cache))
    assert len(again.tokenizer) == len(first.tokenizer)
    assert len(again.train_set) == len(first.train_set) and len(again.val_set) == len(first.val_set)
    assert torch.equal(again.train_set[3]["input_ids"], first.train_set[3]["input_ids"])
    assert torch.equal(again.val_set[0]["labels"], first.val_set[0]["labels"])

    (root / "mod01.py").write_text("def changed():\n    return 1\n" * 50)  # another corpus: another cache entry
    monkeypatch.undo()
    module(root, monkeypatch, cache_dir=str(cache))
    assert len([p for p in cache.iterdir() if (p / "done").is_file()]) == 2
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no scratch folder left behind


def test_validation_masks_are_fixed_and_leave_the_runs_rng_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_stdlib(tmp_path / "lib")
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = module(root, monkeypatch)
    assert torch.equal(torch.random.get_rng_state(), state)
    # a WordPiece vocabulary trained twice may number its tokens differently, so the same masked positions ...
    b = module(root, monkeypatch)
    batch_a, batch_b = next(iter(a.val_dataloader())), next(iter(b.val_dataloader()))
    assert torch.equal(batch_a["labels"] != -100, batch_b["labels"] != -100)
    # ... and, with one tokenizer (from the cache, as a study's runs share it), the same batches exactly
    cache = str(tmp_path / "cache")
    batch_a = next(iter(module(root, monkeypatch, cache_dir=cache).val_dataloader()))
    batch_b = next(iter(module(root, monkeypatch, cache_dir=cache).val_dataloader()))
    assert torch.equal(batch_a["labels"], batch_b["labels"]) and torch.equal(batch_a["input_ids"], batch_b["input_ids"])
    masked = batch_a["labels"] != -100
    assert 0.05 < masked.float().mean() < 0.3  # ~15% of the tokens, never [CLS]/[SEP]
    assert not masked[:, 0].any() and not masked[:, -1].any()
    other = module(root, monkeypatch, val_mask_seed=1)
    assert not torch.equal(next(iter(other.val_dataloader()))["labels"], batch_a["labels"])
    # training batches are masked afresh every time
    train_batch = a.collate_fn([a.train_set[i] for i in range(8)])
    assert not torch.equal(train_batch["labels"], a.collate_fn([a.train_set[i] for i in range(8)])["labels"])


def test_too_few_files_for_a_validation_split_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_stdlib(tmp_path / "lib", files=2)
    with pytest.raises(text.RecipeError, match="chosen for validation"):
        module(root, monkeypatch, val_fraction=0.001)

"""Token shards: ``simigrad-prepare-text`` writes the token ids the in-memory module would hold, and
``TokenShardsDataModule`` serves every block of them once, masks validation blocks alike in every run, refuses
folders it cannot trust, and trains ``experiment=bert_tiny_stdlib_shards`` end to end.

Two preparations are shared by the tests: a corpus of text files written into a temporary folder (one worker, in
this process, a WordPiece vocabulary trained) and ``pydoc_data.topics`` (two worker processes, the first one's
tokenizer given by path).
"""

from __future__ import annotations

import csv
import json
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_simigrad_recipes.data import prepare_text
from lightning_simigrad_recipes.data.prepare_text import main as prepare
from lightning_simigrad_recipes.data.text import MaskedTextDataModule, read_lines
from lightning_simigrad_recipes.data.text_shards import TokenShardsDataModule
from lightning_simigrad_recipes.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]
VAL_FRACTION = 0.2


def write_corpus(root: Path) -> Path:
    """Forty text files from pydoc's topics, two of them in a subfolder, one empty and one of blank lines only."""
    from pydoc_data.topics import topics

    for i, name in enumerate(sorted(topics)[:40]):
        folder = root / ("nested" if i % 20 == 0 else "")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.txt").write_text(topics[name], encoding="utf-8")
    (root / "empty.txt").write_text("")
    (root / "blank.txt").write_text("\n   \n\n")
    return root


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("shards")
    corpus = write_corpus(base / "corpus")
    files = ["--files", f"{corpus}/**/*.txt", "--val-fraction", str(VAL_FRACTION)]
    prepare([*files, "--vocab-size", "1000", "--workers", "1", "--out", str(base / "files")])
    tokenizer = str(base / "files" / "tokenizer")
    pydoc = ["--source", "pydoc", "--val-fraction", str(VAL_FRACTION), "--tokenizer-path", tokenizer]
    prepare([*pydoc, "--workers", "2", "--out", str(base / "pydoc")])
    return {"corpus": corpus, "files": base / "files", "pydoc": base / "pydoc", "tokenizer": Path(tokenizer)}


def in_memory(prepared: dict[str, Path], source: str) -> MaskedTextDataModule:
    """The in-memory module on the same documents, split and tokenizer; no masks, so its blocks can be read back."""
    dm = MaskedTextDataModule(
        source=source,
        files=f"{prepared['corpus']}/**/*.txt" if source == "files" else None,
        tokenizer={"path": str(prepared["tokenizer"])},
        max_seq_length=16,
        split="documents",
        val_fraction=VAL_FRACTION,
        val_mask_seed=None,
    )
    dm.check_inputs()
    return dm


def shards(folder: Path, split: str) -> list[np.ndarray]:
    index = json.loads((folder / "index.json").read_text())
    return [np.fromfile(folder / s["file"], dtype=index["dtype"]) for s in index["shards"][split]]


def module(folder: Path | None, **kwargs) -> TokenShardsDataModule:
    path = str(folder) if folder is not None else None
    dm = TokenShardsDataModule(path=path, **({"max_seq_length": 16, "batch_size": 8} | kwargs))
    dm.check_inputs()
    return dm


def unmasked(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The blocks before masking: the collator keeps each masked token's original id in ``labels``."""
    return torch.where(batch["labels"] != -100, batch["labels"], batch["input_ids"])


@pytest.mark.parametrize("source", ["files", "pydoc"])
def test_the_shards_hold_the_token_ids_of_the_in_memory_module(prepared: dict[str, Path], source: str) -> None:
    folder = prepared[source]
    index = json.loads((folder / "index.json").read_text())
    reference = in_memory(prepared, source)
    assert index["format"] == 1 and index["dtype"] == "uint16" and index["vocab_size"] == 1000
    for split, dataset in (("train", reference.train_set), ("val", reference.val_set)):
        # the shards, joined in the index's order, are the in-memory stream of the split: same documents, same
        # order, same ids; each shard's size is the count the index gives it
        stream = np.concatenate(shards(folder, split))
        assert np.array_equal(stream, dataset.tokens), split
        assert [len(s) for s in shards(folder, split)] == [s["tokens"] for s in index["shards"][split]]
        assert index["tokens"][split] == len(stream)
    expected_shards = 1 if source == "files" else 2  # one per worker and split
    assert [len(index["shards"][s]) for s in ("train", "val")] == [expected_shards, expected_shards]
    documents = index["documents"]
    assert documents["train"] == sum(s["documents"] for s in index["shards"]["train"]) > documents["val"] > 0
    assert documents["train"] + documents["val"] == (42 if source == "files" else 79)


def test_every_training_block_is_served_once(prepared: dict[str, Path]) -> None:
    dm = module(prepared["pydoc"])
    block = 14
    # blocks are cut per shard: a shard's tail shorter than a block is not served, no block joins two shards
    expected = [s[: len(s) // block * block].reshape(-1, block) for s in shards(prepared["pydoc"], "train")]
    bodies = np.concatenate(expected).astype(np.int64)
    assert len(dm.train_set) == len(bodies)
    first = dm.train_set[0]["input_ids"]
    assert first[0] == dm.tokenizer.cls_token_id and first[-1] == dm.tokenizer.sep_token_id and len(first) == 16
    # one epoch of the shuffled, masked training loader: every block once
    served = torch.cat([unmasked(batch) for batch in dm.train_dataloader()])
    assert (served[:, 0] == dm.tokenizer.cls_token_id).all() and (served[:, -1] == dm.tokenizer.sep_token_id).all()
    assert sorted(map(tuple, served[:, 1:-1].tolist())) == sorted(map(tuple, bodies.tolist()))


def test_a_pickled_shard_dataset_maps_its_files_again(prepared: dict[str, Path]) -> None:
    # DataLoader workers under the spawn start method, and spawned DDP processes, receive the datasets pickled
    dm = module(prepared["pydoc"])
    payload = pickle.dumps(dm.train_set)
    assert len(payload) < 4096  # paths and counts, not the token ids
    again = pickle.loads(payload)
    assert isinstance(again.datasets[0].tokens, np.memmap) and len(again) == len(dm.train_set)
    for i in (0, len(again) // 2, len(again) - 1):
        assert torch.equal(again[i]["input_ids"], dm.train_set[i]["input_ids"])


def test_validation_masks_are_the_same_in_every_run_and_leave_the_rng_alone(prepared: dict[str, Path]) -> None:
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a, b = module(prepared["pydoc"]), module(prepared["pydoc"])
    n = len(a.val_set)
    read_a = [a.val_set[i] for i in range(n)]
    read_b = [b.val_set[i] for i in reversed(range(n))][::-1]  # a block's masks do not depend on what came before
    assert torch.equal(torch.random.get_rng_state(), state)  # building and reading drew nothing from the run's RNG
    for x, y in zip(read_a, read_b):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
    batch = next(iter(a.val_dataloader()))  # stacked as the dataset masked them, not masked again
    assert torch.equal(batch["labels"], torch.stack([r["labels"] for r in read_a[: len(batch["labels"])]]))
    labels = torch.stack([r["labels"] for r in read_a])
    masked = labels != -100
    assert 0.08 < masked.float().mean() < 0.25  # ~15% of the tokens, never [CLS]/[SEP]
    assert not masked[:, 0].any() and not masked[:, -1].any()
    bodies = np.concatenate([s[: len(s) // 14 * 14].reshape(-1, 14) for s in shards(prepared["pydoc"], "val")])
    assert np.array_equal(unmasked({"input_ids": torch.stack([r["input_ids"] for r in read_a]), "labels": labels})
                          [:, 1:-1].numpy(), bodies)  # fmt: skip
    other = module(prepared["pydoc"], val_mask_seed=1)
    assert not torch.equal(torch.stack([other.val_set[i]["labels"] for i in range(n)]), labels)


def test_the_model_gets_the_vocabulary_and_length(prepared: dict[str, Path]) -> None:
    dm = module(prepared["files"], max_seq_length=64)
    assert dm.model_kwargs() == {"vocab_size": 1000, "pad_token_id": dm.tokenizer.pad_token_id, "max_seq_length": 64}


def copy_of(prepared: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(prepared["files"], tmp_path / "copy"))


def test_folders_it_cannot_trust_are_refused(prepared: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"data.path is not set: give the folder simigrad-prepare-text wrote"):
        module(None)
    with pytest.raises(RecipeError, match=r"does not exist: run simigrad-prepare-text first, e.g. .*--out"):
        module(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match=r"holds no index.json \(no complete preparation\): run simigrad-prepare"):
        module(tmp_path / "empty")
    folder = copy_of(prepared, tmp_path)
    with pytest.raises(RecipeError, match=r"longer than any training shard .* the longest holds \d+ tokens"):
        module(folder, max_seq_length=10**7)
    shard = folder / "train" / "00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(RecipeError, match=r"train/00000.bin holds \d+ bytes, but index.json gives it \d+ uint16"):
        module(folder)
    shard.unlink()
    with pytest.raises(RecipeError, match=r"train/00000.bin is missing, .* prepare it again"):
        module(folder)
    index = json.loads((folder / "index.json").read_text())
    (folder / "index.json").write_text(json.dumps(index | {"format": 99}))
    with pytest.raises(RecipeError, match=r"format version 99, this version of the recipes reads 1"):
        module(folder)


def test_a_complete_preparation_is_kept_unless_overwrite(
    prepared: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = copy_of(prepared, tmp_path)
    before = (folder / "index.json").read_text()
    args = ["--files", f"{prepared['corpus']}/**/*.txt", "--val-fraction", str(VAL_FRACTION), "--workers", "1"]
    args += ["--tokenizer-path", str(prepared["tokenizer"]), "--out", str(folder)]
    with pytest.raises(SystemExit) as stop:
        prepare(args)
    assert stop.value.code == 2
    assert "already holds a complete preparation (index.json); give another --out, or add --overwrite" in (
        capsys.readouterr().err
    )
    assert (folder / "index.json").read_text() == before
    prepare([*args, "--overwrite"])
    assert json.loads((folder / "index.json").read_text())["tokens"] == json.loads(before)["tokens"]
    assert not list(folder.glob(".*"))  # no scratch index left behind


def test_an_interrupted_preparation_is_never_read_as_complete(
    prepared: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = copy_of(prepared, tmp_path)  # complete, then overwritten by a run that fails half-way
    write_shard = prepare_text.write_shard

    def fail_on_val(tokenizer_dir: str, dtype: str, path: Path, documents: list) -> int:
        if path.parent.name == "val":
            raise OSError("disk full")
        return write_shard(tokenizer_dir, dtype, path, documents)

    monkeypatch.setattr(prepare_text, "write_shard", fail_on_val)
    args = ["--files", f"{prepared['corpus']}/*.txt", "--val-fraction", "0.5", "--workers", "1"]
    with pytest.raises(OSError, match="disk full"):
        prepare([*args, "--tokenizer-path", str(prepared["tokenizer"]), "--out", str(folder), "--overwrite"])
    assert (folder / "train" / "00000.bin").is_file() and not (folder / "index.json").exists()
    with pytest.raises(RecipeError, match="holds no index.json"):
        module(folder)


def test_user_errors_of_the_command_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        prepare(["--files", f"{tmp_path}/none/*.txt", "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --files='{tmp_path}/none/*.txt' matched no files; give a glob of UTF-8 text files, quoted,"
        " e.g. --files='/data/wiki/*.txt'"
    ]
    with pytest.raises(SystemExit) as stop:
        prepare(["--source", "pydoc", "--val-fraction", "0.0001", "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert "0 of them chosen for validation by --val-fraction=0.0001" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        prepare(["--source", "pydoc", "--workers", "0", "--out", str(tmp_path / "out")])
    assert stop.value.code == 2 and "--workers: 0 is not a positive whole number" in capsys.readouterr().err


def test_help_names_every_option_and_the_next_step(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        prepare(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--source", "--files", "--val-fraction", "--tokenizer-path", "--vocab-size", "--no-lowercase",
                   "--tokenizer-sample-mb", "--out", "--workers", "--overwrite"):  # fmt: skip
        assert option in text
    assert "data=text_shards data.path=OUT" in text
    # the console script (tomllib is Python 3.11's; the package supports 3.10)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'simigrad-prepare-text = "lightning_simigrad_recipes.data.prepare_text:main"' in pyproject


def test_the_vocabulary_sample_is_bounded_and_spread_over_the_documents(prepared: dict[str, Path]) -> None:
    documents = [(str(p), p) for p in sorted(prepared["corpus"].rglob("*.txt"))]
    whole = list(read_lines(documents))
    assert list(prepare_text.sample_lines(documents, 10**9)) == whole  # within the budget: all of it, in order
    budget = 20_000
    sample = list(prepare_text.sample_lines(documents, budget))
    longest = max(len(line.encode()) for line in whole)
    assert budget <= sum(len(line.encode()) for line in sample) <= budget + len(documents) * longest
    topics = {line for line in sample if line.strip()}
    reached = [d for d in documents if topics & set(read_lines([d]))]
    assert len(reached) == len(documents) - 2  # every document with text (not the empty and the blank one)


def test_bert_tiny_stdlib_shards_smoke_trains_from_a_prepared_folder(
    prepared: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_simigrad_recipes.train import main

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # main() sets it; keep it from leaking into other tests
    run_dir = tmp_path / "run"
    argv = ["experiment=bert_tiny_stdlib_shards", "debug=smoke", f"data.path={prepared['pydoc']}", "logger=none"]
    monkeypatch.setattr(sys, "argv", ["simigrad-train", *argv, f"hydra.run.dir={run_dir}"])
    main()
    out = capsys.readouterr().out
    assert "bert_tiny_stdlib_shards-paper-seed0: val/loss" in out and "val/mlm_acc" in out
    with (run_dir / "simigrad_trace.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4

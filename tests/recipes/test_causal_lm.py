"""The causal-LM recipe with batches in tokens: its smoke run through ``simigrad-train``, the loss items, the documents.

The smoke run reads the real standard library's ``email`` package; the documents' tests make a small "standard
library" of ``.py`` files of varied sizes in tmp_path.
"""

from __future__ import annotations

import csv
import functools
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_simigrad_recipes.data import documents, text
from lightning_simigrad_recipes.data.documents import DocumentsDataModule, PadToLongest, cut_documents
from lightning_simigrad_recipes.data.text import in_validation
from lightning_simigrad_recipes.models.causal_lm import CausalLM


# ---- (a) the smoke run, as users run it
def test_smoke_run_counts_every_step_in_the_tokens_of_its_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_simigrad_recipes.train import main

    seen: dict[int, list[tuple[int, int]]] = defaultdict(list)  # step -> (real tokens, padded tokens) per micro-batch
    original = CausalLM.training_step

    def recording(self: CausalLM, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        seen[self.trainer.global_step].append((int(batch["attention_mask"].sum()), batch["input_ids"].numel()))
        return original(self, batch, batch_idx)

    monkeypatch.setattr(CausalLM, "training_step", recording)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # main() sets it; keep it from leaking into other tests
    run_dir = tmp_path / "run"
    argv = ["experiment=gpt_tiny_stdlib", "debug=smoke", "logger=csv", "num_threads=2", f"hydra.run.dir={run_dir}"]
    monkeypatch.setattr(sys, "argv", ["simigrad-train", *argv])
    main()
    out = capsys.readouterr().out
    assert "gpt_tiny_stdlib-paper-seed0: val/acc" in out
    # the end-of-fit line says its unit, B0 as given, and the range of the steps it trained
    line = next(line for line in out.splitlines() if line.startswith("SimiGrad batch size"))
    match = re.search(
        r"\(tokens\) moved through (\d+)\.\.(\d+) over \d+ steps \(B0 = 256, first step (\d+), last step (\d+);"
        r" the next would be \d+\): [\d,]+ tokens in [\d,]+ samples",
        line,
    )
    assert match, line
    low, high, first, last = (int(group) for group in match.groups())
    assert low <= first <= high and low <= last <= high

    with (run_dir / "simigrad_trace.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(float(r["step"])) for r in rows] == sorted(seen) == list(range(len(rows)))
    assert 2 <= len(rows) <= 4  # debug=smoke: max_steps=4 steps of B0 = 256 tokens
    for row in rows:
        micro = seen[int(float(row["step"]))]
        assert float(row["batch_size"]) == sum(real for real, _ in micro)  # the step's tokens, not its samples
        assert float(row["accumulation"]) == len(micro) >= 2  # one micro-batch per half at least
        assert all(padded <= 128 for _, padded in micro)  # the smoke block's max_micro_batch_tokens
    sizes = [float(r["batch_size"]) for r in rows]
    assert float(rows[-1]["tokens_seen"]) == sum(sizes) >= 4 * 256 - 16  # the budget, within half a sample of 32
    assert (low, high, first, last) == (min(sizes), max(sizes), sizes[0], sizes[-1])
    assert f"{int(sum(sizes)):,} tokens in" in line
    assert max(sizes) > 32 * 2  # counted in tokens: no step of a few samples reads as its sample count
    assert list(run_dir.glob("logs/*/metrics.csv"))


# ---- (b) loss items
def tiny_model(vocab: int = 50) -> CausalLM:
    torch.manual_seed(0)
    config = dict(n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return CausalLM(config, vocab, 0, functools.partial(torch.optim.AdamW, lr=1e-3))


def test_loss_items_count_exactly_the_tokens_the_loss_averages() -> None:
    model = tiny_model().double()
    lengths = [7, 1, 12, 3, 12, 2]  # a one-token sample predicts nothing; two of the longest
    generator = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(1, 50, (n,), generator=generator)} for n in lengths]
    batch = PadToLongest(pad_token_id=0)(samples)
    loss, _, _ = model._step(batch)
    items = CausalLM.loss_items(batch)
    assert int(items) == sum(n - 1 for n in lengths) == 31  # the first token of each sample is never predicted

    # reference: each sample alone, unpadded, through GPT2LMHeadModel's own logits, summed in float64
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for sample in samples:
            ids = sample["input_ids"][None]
            logp = torch.log_softmax(model.gpt(input_ids=ids).logits[0].double(), -1)
            total += -logp[:-1].gather(1, ids[0, 1:, None]).sum()
    assert abs(float(loss.detach()) * int(items) - float(total)) < 1e-9 * float(total)
    # the mean over every labelled token (first ones included) or over every position would differ
    assert abs(float(loss.detach()) - float(total) / sum(lengths)) > 1e-3


def test_a_micro_batch_that_predicts_nothing_has_a_finite_zero_loss() -> None:
    batch = PadToLongest(pad_token_id=0)([{"input_ids": torch.tensor([5])}, {"input_ids": torch.tensor([7])}])
    loss, _, n = tiny_model()._step(batch)
    assert int(CausalLM.loss_items(batch)) == n == 0 and float(loss.detach()) == 0.0
    loss.backward()  # SimiGrad weighs it by its 0 items; it must still run backward


# ---- (c) the documents
def make_stdlib(root: Path, files: int = 16) -> Path:
    rng = np.random.default_rng(0)
    for i in range(files):
        folder = root / ("pkg" if i % 3 == 0 else "")
        folder.mkdir(parents=True, exist_ok=True)
        lines = int(rng.integers(0, 40)) if i % 4 else int(rng.integers(60, 120))  # short files, long files
        body = "".join(f"    value_{i}_{j} = compute({j}, 'text {i}')  # é\n" for j in range(lines))
        (folder / f"mod{i:02d}.py").write_text(f"def f{i}():\n{body}", encoding="utf-8")
    (root / "empty.py").write_text("")  # no tokens: no sample
    (root / "site-packages").mkdir()
    (root / "site-packages" / "x.py").write_text("installed = 1\n" * 50)
    return root


def module(root: Path, monkeypatch: pytest.MonkeyPatch, **kwargs) -> DocumentsDataModule:
    monkeypatch.setattr(text, "stdlib_root", lambda: root)
    args = dict(source="stdlib", tokenizer=dict(train=True, vocab_size=300), max_seq_length=32, val_fraction=0.3)
    dm = DocumentsDataModule(**(args | kwargs))
    dm.output_dir = root.parent / "run"
    dm.check_inputs()
    return dm


def test_each_file_becomes_pieces_of_its_tokens_split_by_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = make_stdlib(tmp_path / "lib")
    dm = module(root, monkeypatch)
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if "site-packages" not in p.parts)
    assert set(dm.documents["val"]) == {n for n in names if in_validation(n, 0.3)}
    assert set(dm.documents["train"]) == {n for n in names if not in_validation(n, 0.3)}
    assert dm.documents["val"] and not set(dm.documents["train"]) & set(dm.documents["val"])

    for split, dataset in (("train", dm.train_set), ("val", dm.val_set)):
        offsets = dm.offsets[split]
        pieces = [dataset[i]["input_ids"] for i in range(len(dataset))]
        assert all(1 <= len(p) <= 32 for p in pieces)
        assert [len(p) for p in pieces] == dataset.lengths.tolist()
        by_start = dict(zip(dataset.starts.tolist(), pieces))
        for d, name in enumerate(dm.documents[split]):
            ids = [by_start[s] for s in sorted(by_start) if offsets[d] <= s < offsets[d + 1]]
            joined = torch.cat(ids).tolist() if ids else []
            text_ = (root / name).read_text(encoding="utf-8")
            assert joined == dm.tokenizer(text_, add_special_tokens=False)["input_ids"]  # the file's tokens, in order
            assert dm.tokenizer.decode(joined) == text_  # byte-level: indentation and newlines kept
            assert all(len(p) == 32 for p in ids[:-1])  # only the last piece is shorter
    lengths = dm.lengths
    assert len(set(lengths.tolist())) >= 5 and lengths.min() < 16 and lengths.max() == 32  # lengths vary
    assert (dm.val_set.lengths[:-1] >= dm.val_set.lengths[1:]).all()  # validation: longest first, a fixed order


def test_padding_is_labelled_minus_100_and_masked() -> None:
    batch = PadToLongest(pad_token_id=3)([{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": torch.tensor([8])}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 3, 3]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_cut_documents_leaves_no_token_out() -> None:
    offsets = np.array([0, 1, 1, 65, 70, 200])
    starts, lengths = cut_documents(offsets, 32)
    assert lengths.tolist() == [1, 32, 32, 5, 32, 32, 32, 32, 2]
    assert (np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)]) == np.arange(200)).all()


def test_the_token_cache_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_stdlib(tmp_path / "lib", files=8)
    cache = tmp_path / "cache"
    first = module(root, monkeypatch, cache_dir=str(cache))
    (folder,) = cache.iterdir()
    assert folder.name.startswith("stdlib-documents-") and (folder / "done").is_file()

    def fail(*args, **kwargs):
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(documents, "train_bpe", fail)
    monkeypatch.setattr(documents, "encode_documents", fail)
    again = module(root, monkeypatch, cache_dir=str(cache), max_seq_length=16)  # cut again, not tokenized again
    assert (again.offsets["train"] == first.offsets["train"]).all()
    assert again.lengths.sum() == first.lengths.sum() and again.lengths.max() == 16

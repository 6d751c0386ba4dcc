"""Masked-LM pretraining text: local files (a glob), CPython's standard library sources, or ``pydoc_data``.

The corpus is tokenized into one token stream per split and cut into blocks of ``max_seq_length``
tokens (``[CLS] ... [SEP]``), as BERT's sequence-length-128 phase does; 15% of the training tokens are
masked per batch by ``transformers.DataCollatorForLanguageModeling``. The validation blocks are masked
once, with a fixed seed, so every run is scored on the same masked tokens. Everything is held in memory
(int32 token ids, and more while tokenizing), which suits a corpus of some hundred MB. A corpus larger than
memory (Wikipedia) is tokenized once into token shards on disk by ``simigrad-prepare-text`` (:mod:`.prepare_text`)
and read memory-mapped by :class:`~.text_shards.TokenShardsDataModule` (``data=text_shards``); the preparation
reads, splits and tokenizes the corpus with this module's functions, so both give the same token ids.

With ``cache_dir`` set, the tokenizer and both token streams are kept there, under a key made of the
corpus (file names, sizes, modification times), the split and the tokenizer settings: a repeated run (a
study runs dozens) loads them in a second instead of training a vocabulary and tokenizing again.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import shutil
import sysconfig
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

from lightning_simigrad_recipes.data.base import TokenizedDataModule
from lightning_simigrad_recipes.data.tokenizer import build_tokenizer, load_tokenizer
from lightning_simigrad_recipes.errors import RecipeError

SOURCES = ("files", "stdlib", "pydoc")
SPLITS = ("tail", "documents")


def expand_files(files: str | list[str] | None, root: Path | None = None, setting: str = "data.files") -> list[Path]:
    """Expand ``data.files`` (one glob, or a list of globs/paths) into existing files, relative to ``root``.

    ``setting`` is what the user typed the globs as (``data.files``, or ``--files`` of ``simigrad-prepare-text``),
    for the messages.
    """
    if not files:
        raise RecipeError(f"{setting} is not set: give the text corpus, e.g. {setting}='/data/wiki/*.txt'")
    patterns = [files] if isinstance(files, str) else list(files)
    if root is not None:
        patterns = [str(root / p) for p in patterns]
    found = sorted({Path(p) for pat in patterns for p in glob.glob(os.path.expanduser(pat), recursive=True)})
    found = [p for p in found if p.is_file()]
    if not found:
        raise RecipeError(
            f"{setting}={patterns if len(patterns) > 1 else patterns[0]!r} matched no files; "
            f"give a glob of UTF-8 text files, quoted, e.g. {setting}='/data/wiki/*.txt'"
        )
    return found


def stdlib_root() -> Path:
    """The folder of this interpreter's standard library (its ``.py`` sources on every CPython install)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(patterns: str | list[str], setting: str = "data.files") -> list[Path]:
    """The standard library's files matching ``patterns`` (globs relative to its folder), without installed packages."""
    root = stdlib_root()
    return [
        p
        for p in expand_files(patterns, root, setting)
        if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    ]


def in_validation(name: str, val_fraction: float) -> bool:
    """A document's split, fixed by its name alone: the same on every machine, whatever else the corpus holds."""
    return zlib.crc32(name.encode()) / 2**32 < val_fraction


Document = tuple[str, Path | str]  # (name, path or text); the name decides the split


def corpus_documents(source: str, files: str | list[str] | None, setting: str = "data.files") -> list[Document]:
    """The corpus as named documents, in a fixed order (sorted paths, or pydoc's sorted topics).

    Only names and paths: the text is read later, line by line (:func:`read_lines`).
    """
    if source == "pydoc":
        from pydoc_data.topics import topics

        return [(name, topics[name]) for name in sorted(topics)]
    if source == "stdlib":
        root = stdlib_root()
        return [(p.relative_to(root).as_posix(), p) for p in stdlib_files(files or "**/*.py", setting)]
    return [(str(p), p) for p in expand_files(files, setting=setting)]


def describe_corpus(source: str, files: str | list[str] | None, setting: str = "data.files") -> str:
    """Where the text comes from, as a message names it."""
    return {"pydoc": "pydoc_data.topics", "stdlib": "the standard library"}.get(source, f"{setting}={files!r}")


def read_lines(documents: Iterable[Document]) -> Iterator[str]:
    """The documents' lines in order, one file open at a time: nothing is held beyond the current line."""
    for _, doc in documents:
        if isinstance(doc, str):
            yield from doc.splitlines()
            continue
        with doc.open(encoding="utf-8", errors="replace") as f:
            yield from f


def split_documents(
    documents: list[Document], val_fraction: float, where: str, setting: str = "data.val_fraction"
) -> tuple[list[Document], list[Document]]:
    """``(train, val)`` by :func:`in_validation`; both must hold a document, or the message says what to change."""
    val_docs = [d for d in documents if in_validation(d[0], val_fraction)]
    train_docs = [d for d in documents if not in_validation(d[0], val_fraction)]
    if not val_docs or not train_docs:
        raise RecipeError(
            f"{where} holds {len(documents)} documents, {len(val_docs)} of them chosen for"
            f" validation by {setting}={val_fraction}; give more files or change {setting}"
        )
    return train_docs, val_docs


LINES_PER_CALL = 2048  # lines per tokenizer call: the fast tokenizer's batch, small enough to hold


def encode_lines(tokenizer: PreTrainedTokenizerFast, lines: Iterable[str]) -> Iterator[np.ndarray]:
    """The token ids of ``lines`` without special tokens, one int32 array per call of ``LINES_PER_CALL`` non-blank
    lines: concatenated, the corpus' token stream, which both the in-memory module and the shards hold."""
    batch: list[str] = []
    for line in lines:
        if line.strip():
            batch.append(line)
        if len(batch) == LINES_PER_CALL:
            yield _encode(tokenizer, batch)
            batch = []
    if batch:
        yield _encode(tokenizer, batch)


def _encode(tokenizer: PreTrainedTokenizerFast, lines: list[str]) -> np.ndarray:
    ids = tokenizer(lines, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32)


def cache_folder(
    cache_dir: Path, name: str, settings: dict[str, Any], documents: list[Document], tokenizer_path: str | None
) -> Path:
    """``cache_dir/<name>-<digest>``: the digest of ``settings`` (what the ids depend on besides the text), the
    documents' names, sizes and modification times, and the files of a tokenizer given by path."""
    key: dict[str, Any] = {
        **settings,
        "documents": [
            [title, doc.stat().st_size, doc.stat().st_mtime_ns] if isinstance(doc, Path) else [title, len(doc)]
            for title, doc in documents
        ],
    }
    if tokenizer_path:  # a tokenizer given by path: its files are part of what the ids mean
        key["tokenizer_files"] = sorted(
            [p.name, p.stat().st_size, p.stat().st_mtime_ns]
            for p in Path(tokenizer_path).expanduser().glob("*")
            if p.is_file()
        )
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"{name}-{digest}"


def save_cache(
    folder: Path, tokenizer: PreTrainedTokenizerFast, arrays: dict[str, np.ndarray], done: dict[str, Any]
) -> None:
    """Write ``tokenizer/``, ``<name>.npy`` per array and ``done`` into a scratch folder and rename it into place, so a
    reader never sees half a cache."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    tokenizer.save_pretrained(str(scratch / "tokenizer"))
    for name, array in arrays.items():
        np.save(scratch / f"{name}.npy", array)
    (scratch / "done").write_text(json.dumps(done))
    try:
        scratch.rename(folder)
    except OSError:  # another process finished the same cache first: keep theirs
        shutil.rmtree(scratch, ignore_errors=True)


class TokenBlocks(Dataset[dict[str, torch.Tensor]]):
    """Blocks ``[CLS] t_i .. t_{i+n} [SEP]`` cut from one token stream."""

    def __init__(self, tokens: np.ndarray, block: int, cls_id: int, sep_id: int) -> None:
        self.tokens, self.block, self.cls_id, self.sep_id = tokens, block, cls_id, sep_id

    def __len__(self) -> int:
        return len(self.tokens) // self.block

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        body = self.tokens[index * self.block : (index + 1) * self.block]
        ids = np.concatenate([[self.cls_id], body, [self.sep_id]]).astype(np.int64)
        return {"input_ids": torch.from_numpy(ids)}


class MaskedBlocks(Dataset[dict[str, torch.Tensor]]):
    """Blocks masked once: ``input_ids`` and ``labels`` (-100 where nothing is to be predicted)."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        self.input_ids, self.labels = input_ids, labels

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


class MaskedTextDataModule(TokenizedDataModule):
    """Text corpus for BERT masked-LM pretraining.

    Args:
        files: a glob (or list of globs) of text files; with ``source="stdlib"``, globs relative to the
            standard library's folder (default ``"**/*.py"``); ignored when ``source="pydoc"``.
        source: ``"files"``, ``"stdlib"`` (``sysconfig.get_paths()["stdlib"]``, installed packages left
            out) or ``"pydoc"`` (CPython's ``pydoc_data.topics``, always present).
        tokenizer: the ``tokenizer`` config: ``path`` (local vocab.txt folder or tokenizer.json),
            ``train`` (train WordPiece on the training split when no path), ``vocab_size``, ``lowercase``.
        max_seq_length: tokens per sequence including ``[CLS]`` and ``[SEP]``.
        mlm_probability: share of tokens masked (BERT: 0.15).
        val_fraction: share held out for validation: of the blocks (``split="tail"``, the end of the
            stream) or of the documents (``split="documents"``, chosen by a hash of each file's path).
        split: ``"tail"`` or ``"documents"`` (no file contributes to both splits).
        val_mask_seed: seed of the validation masks, drawn once (``None``: new masks at every pass).
        cache_dir: folder for the tokenizer and token streams (``None``: no cache, train and tokenize).
        **kwargs: ``batch_size``, ``num_workers``... of :class:`RecipeDataModule`.
    """

    def __init__(
        self,
        files: str | list[str] | None = None,
        source: str = "files",
        tokenizer: Any = None,
        max_seq_length: int = 128,
        mlm_probability: float = 0.15,
        val_fraction: float = 0.01,
        split: str = "tail",
        val_mask_seed: int | None = 0,
        cache_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if source not in SOURCES:
            raise RecipeError(f"data.source={source!r} is unknown; use one of {', '.join(SOURCES)}")
        if split not in SPLITS:
            raise RecipeError(f"data.split={split!r} is unknown; use one of {', '.join(SPLITS)}")
        self.files, self.source, self.split = files, source, split
        self.tokenizer_cfg = dict(tokenizer or {})
        self.max_seq_length = max_seq_length
        self.mlm_probability = mlm_probability
        self.val_fraction = val_fraction
        self.val_mask_seed = val_mask_seed
        self.cache_dir = Path(os.path.expanduser(cache_dir)) if cache_dir else None
        self.output_dir: Path = Path(".")
        self.tokenizer: PreTrainedTokenizerFast | None = None

    def _where(self) -> str:
        return describe_corpus(self.source, self.files)

    # -- build -----------------------------------------------------------------------------------------
    def _build(self) -> None:
        documents = corpus_documents(self.source, self.files)
        if self.split == "documents":
            train_docs, val_docs = split_documents(documents, self.val_fraction, self._where())
        else:
            train_docs, val_docs = documents, []
        folder = self._cache_folder(documents) if self.cache_dir is not None else None
        if folder is not None and (folder / "done").is_file():
            self.tokenizer = load_tokenizer(str(folder / "tokenizer"))
            streams = [np.load(folder / f"{name}.npy", mmap_mode="r") for name in ("train", "val")]
        else:
            # with a cache, a trained tokenizer goes to a scratch folder and is kept with the token streams
            save_dir = Path(tempfile.mkdtemp(prefix="simigrad-tokenizer-")) if folder else self.output_dir / "tokenizer"
            try:
                self.tokenizer = self._tokenizer(train_docs, save_dir)
                streams = [self._encode_all(train_docs), self._encode_all(val_docs)]
                if folder is not None:
                    self._save(folder, streams)
            finally:
                if folder is not None:
                    shutil.rmtree(save_dir, ignore_errors=True)
        self._make_datasets(*streams)

    def _tokenizer(self, train_docs: list[Document], save_dir: Path) -> PreTrainedTokenizerFast:
        cfg = self.tokenizer_cfg
        return build_tokenizer(
            path=cfg.get("path"),
            train=bool(cfg.get("train", False)),
            vocab_size=int(cfg.get("vocab_size", 30522)),
            lowercase=bool(cfg.get("lowercase", True)),
            texts=read_lines(train_docs),  # the vocabulary never sees the validation text
            save_dir=save_dir,
        )

    def _encode_all(self, documents: list[Document]) -> np.ndarray:
        assert self.tokenizer is not None
        chunks = list(encode_lines(self.tokenizer, read_lines(documents)))
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)

    def _make_datasets(self, train_tokens: np.ndarray, val_tokens: np.ndarray) -> None:
        assert self.tokenizer is not None
        block = self.max_seq_length - 2
        if self.split == "tail":  # one stream: the validation blocks are its last ones
            n_blocks = len(train_tokens) // block
            if n_blocks < 2:
                raise RecipeError(
                    f"{self._where()} gives {len(train_tokens)} tokens, fewer than two blocks of"
                    f" {self.max_seq_length}; add text or lower data.max_seq_length"
                )
            n_val = max(1, int(n_blocks * self.val_fraction))
            cut = (n_blocks - n_val) * block
            train_tokens, val_tokens = train_tokens[:cut], train_tokens[cut : n_blocks * block]
        for name, tokens in (("training", train_tokens), ("validation", val_tokens)):
            if len(tokens) < block:
                raise RecipeError(
                    f"the {name} files of {self._where()} give {len(tokens)} tokens, less than one block of"
                    f" {self.max_seq_length}; add text, change data.val_fraction or lower data.max_seq_length"
                )
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        self.train_set = TokenBlocks(train_tokens, block, cls_id, sep_id)
        self.collate_fn = DataCollatorForLanguageModeling(self.tokenizer, mlm_probability=self.mlm_probability)
        val_blocks = TokenBlocks(val_tokens, block, cls_id, sep_id)
        if self.val_mask_seed is None:
            self.val_set = val_blocks
            return
        with torch.random.fork_rng():  # the same masks in every run, without touching the run's RNG
            torch.manual_seed(self.val_mask_seed)
            masked = self.collate_fn([val_blocks[i] for i in range(len(val_blocks))])
        self.val_set = MaskedBlocks(masked["input_ids"], masked["labels"])

    def val_dataloader(self) -> Any:
        loader = super().val_dataloader()
        if isinstance(self.val_set, MaskedBlocks):  # already masked: stack, do not mask again
            loader.collate_fn = default_collate
        return loader

    # -- cache -----------------------------------------------------------------------------------------
    def _cache_folder(self, documents: list[Document]) -> Path:
        settings: dict[str, Any] = {
            "format": 1,
            "source": self.source,
            "split": self.split,
            "val_fraction": self.val_fraction if self.split == "documents" else None,
            "tokenizer": {k: self.tokenizer_cfg.get(k) for k in ("path", "train", "vocab_size", "lowercase")},
        }
        assert self.cache_dir is not None
        return cache_folder(self.cache_dir, self.source, settings, documents, self.tokenizer_cfg.get("path"))

    def _save(self, folder: Path, streams: list[np.ndarray]) -> None:
        assert self.tokenizer is not None
        arrays = {name: np.asarray(tokens, dtype=np.int32) for name, tokens in zip(("train", "val"), streams)}
        save_cache(folder, self.tokenizer, arrays, {"train_tokens": len(streams[0]), "val_tokens": len(streams[1])})

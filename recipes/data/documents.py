"""Causal-LM documents of varied lengths: each file of a corpus tokenized whole and cut into samples.

Each document (a ``.py`` file of the standard library, a file of ``data.files``, a ``pydoc`` topic) is one token
sequence, cut into pieces of at most ``max_seq_length`` tokens: a short file is one short sample, a long one several
full samples and a shorter tail. The lengths so vary widely, which is what batches counted in tokens are for
(``SimiGrad(lengths=...)``, docs/usage.md "Batches in tokens"). A micro-batch is padded to its longest sample, with
``labels = input_ids`` and -100 on the padding; the model predicts each labelled token from the ones before it.

The vocabulary is a byte-level BPE (GPT-2's scheme) trained here with ``tokenizers`` on the training documents, or a
``tokenizer.json`` given as ``tokenizer.path``: unlike the MLM recipes' WordPiece it keeps every byte, indentation and
newlines included, so a document decodes back to its text. The corpus is read and split as the MLM recipes read it
(:mod:`.text`: whole documents, by a hash of each name), and cached the same way under ``cache_dir``.

A split's ids are held as one int32 array with the offsets of its documents (no tensor per sample); the samples are
cut from them when the data is built, so ``max_seq_length`` can change without tokenizing again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import ByteLevelBPETokenizer
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerFast

from lightning_simigrad_recipes.data.base import TokenizedDataModule
from lightning_simigrad_recipes.data.text import (
    SOURCES,
    Document,
    cache_folder,
    corpus_documents,
    describe_corpus,
    read_lines,
    save_cache,
    split_documents,
)
from lightning_simigrad_recipes.errors import RecipeError

PAD = "<pad>"
HOW = "set tokenizer.path to a tokenizer.json (or its folder), or tokenizer.train=true to train a byte-level BPE"
DOCUMENTS_PER_CALL = 64  # documents per call of the fast tokenizer, which encodes a call's texts in parallel


def sample_tokens(sample: dict[str, torch.Tensor]) -> int:
    """A sample's tokens: ``simigrad.lengths`` of the causal-LM recipe, read once per sample by SimiGrad."""
    return len(sample["input_ids"])


# -- tokenizer ---------------------------------------------------------------------------------------------
def train_bpe(texts: Iterable[str], vocab_size: int, save_dir: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens (``<pad>`` included) trained on ``texts``, saved in ``save_dir``.

    Under DDP every process trains the same vocabulary (deterministic); only local rank 0 writes ``save_dir``.
    """
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        save_dir = Path(tempfile.mkdtemp(prefix="simigrad-tokenizer-"))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[PAD])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token=PAD)
    tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def load_bpe(path: str) -> PreTrainedTokenizerFast:
    """A ``tokenizer.json`` (the file or its folder); its ``<pad>`` pads when it has one, else id 0 (the padding is
    masked out of attention and loss, so its id never matters)."""
    p = Path(path).expanduser()
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file() or file.suffix != ".json":
        raise RecipeError(f"tokenizer.path={path} is not a tokenizer.json or a folder holding one; {HOW}")
    try:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(file))
    except Exception as err:  # tokenizers raises its own Exception subclass
        raise RecipeError(f"tokenizer.path={path} could not be read ({err}); {HOW}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = PAD if PAD in tokenizer.get_vocab() else tokenizer.convert_ids_to_tokens(0)
    return tokenizer


def document_text(document: Document) -> str:
    """A document's text as :func:`~.text.read_lines` reads it (UTF-8, bad bytes replaced, newlines as ``\\n``)."""
    return document[1] if isinstance(document[1], str) else "".join(read_lines([document]))


def encode_documents(tokenizer: PreTrainedTokenizerFast, documents: list[Document]) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, offsets)``: every document's ids in order, one int32 array, and where each begins (int64,
    ``len(documents) + 1`` entries: document ``d`` is ``tokens[offsets[d]:offsets[d + 1]]``). No special tokens."""
    chunks, sizes = [], []
    for start in range(0, len(documents), DOCUMENTS_PER_CALL):
        texts = [document_text(doc) for doc in documents[start : start + DOCUMENTS_PER_CALL]]
        for ids in tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]:
            chunks.append(np.asarray(ids, dtype=np.int32))
            sizes.append(len(ids))
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    return tokens, np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])


def cut_documents(offsets: np.ndarray, max_seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of the samples: each document cut into pieces of ``max_seq_length`` tokens, its last piece
    what is left; a document of no tokens gives none.

    >>> cut_documents(np.array([0, 3, 3, 10]), 4)
    (array([0, 3, 7]), array([3, 4, 3]))
    """
    sizes = np.diff(offsets)
    pieces = -(-sizes // max_seq_length)  # per document, rounded up
    document = np.repeat(np.arange(len(sizes)), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)  # each document's first piece
    starts = offsets[document] + (np.arange(len(document)) - first) * max_seq_length
    return starts, np.minimum(starts + max_seq_length, offsets[document + 1]) - starts


# -- data --------------------------------------------------------------------------------------------------
class DocumentPieces(Dataset[dict[str, torch.Tensor]]):
    """Samples ``tokens[start : start + length]``; ``lengths`` is every sample's tokens, by index."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        self.tokens, self.starts, self.lengths = tokens, starts, lengths

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = int(self.starts[index])
        return {"input_ids": torch.from_numpy(self.tokens[start : start + int(self.lengths[index])].astype(np.int64))}


class PadToLongest:
    """Collate: pad to the micro-batch's longest sample; ``labels`` are the ids, -100 on the padding."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)
        input_ids = torch.full((len(samples), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
        labels = torch.full((len(samples), longest), -100, dtype=torch.long)
        for row, sample in enumerate(samples):
            ids = sample["input_ids"]
            input_ids[row, : len(ids)] = labels[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class DocumentsDataModule(TokenizedDataModule):
    """A corpus of documents for causal-LM training, split by document, in samples of varied lengths.

    Args:
        files: a glob (or list of globs); with ``source="stdlib"`` relative to the standard library's folder (default
            ``"**/*.py"``); ignored with ``source="pydoc"``.
        source: ``"files"``, ``"stdlib"`` (installed packages left out) or ``"pydoc"`` (``pydoc_data.topics``).
        tokenizer: the ``tokenizer`` config: ``path`` (a ``tokenizer.json`` or its folder), ``train`` (train a
            byte-level BPE on the training documents when no path), ``vocab_size``.
        max_seq_length: most tokens of a sample; a longer document becomes several samples.
        val_fraction: share of the documents held out for validation (by a hash of each name).
        cache_dir: folder for the tokenizer and the token ids (``None``: no cache, train and tokenize every run).
        **kwargs: ``batch_size``, ``num_workers``... of :class:`RecipeDataModule`.
    """

    def __init__(
        self,
        files: str | list[str] | None = None,
        source: str = "stdlib",
        tokenizer: Any = None,
        max_seq_length: int = 128,
        val_fraction: float = 0.03,
        cache_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if source not in SOURCES:
            raise RecipeError(f"data.source={source!r} is unknown; use one of {', '.join(SOURCES)}")
        if max_seq_length < 2:
            raise RecipeError(f"data.max_seq_length={max_seq_length}: a sample needs 2 tokens to predict one")
        self.files, self.source = files, source
        self.tokenizer_cfg = dict(tokenizer or {})
        self.max_seq_length = max_seq_length
        self.val_fraction = val_fraction
        self.cache_dir = Path(os.path.expanduser(cache_dir)) if cache_dir else None
        self.output_dir: Path = Path(".")
        self.tokenizer: PreTrainedTokenizerFast | None = None
        self.documents: dict[str, list[str]] = {}  # each split's document names, in the order of its ids
        self.offsets: dict[str, np.ndarray] = {}  # and where each document's ids begin

    def _build(self) -> None:
        documents = corpus_documents(self.source, self.files)
        where = describe_corpus(self.source, self.files)
        train_docs, val_docs = split_documents(documents, self.val_fraction, where)
        folder = self._cache_folder(documents) if self.cache_dir is not None else None
        if folder is not None and (folder / "done").is_file():
            self.tokenizer = load_bpe(str(folder / "tokenizer"))
            arrays = {name: np.load(folder / f"{name}.npy") for name in ("train", "val", "train_at", "val_at")}
        else:
            # with a cache, a trained tokenizer goes to a scratch folder and is kept with the token ids
            save_dir = Path(tempfile.mkdtemp(prefix="simigrad-tokenizer-")) if folder else self.output_dir / "tokenizer"
            try:
                self.tokenizer = self._tokenizer(train_docs, save_dir)
                arrays = {}
                for name, docs in (("train", train_docs), ("val", val_docs)):
                    arrays[name], arrays[f"{name}_at"] = encode_documents(self.tokenizer, docs)
                if folder is not None:
                    save_cache(folder, self.tokenizer, arrays, {k: len(v) for k, v in arrays.items()})
            finally:
                if folder is not None:
                    shutil.rmtree(save_dir, ignore_errors=True)
        sets = {}
        for name, docs in (("train", train_docs), ("val", val_docs)):
            self.documents[name], self.offsets[name] = [d[0] for d in docs], arrays[f"{name}_at"]
            starts, lengths = cut_documents(arrays[f"{name}_at"], self.max_seq_length)
            if not len(starts):
                raise RecipeError(f"the {name} documents of {where} hold no tokens; give more files or change data.*")
            if name == "val":  # longest first: a fixed order that pads little, and the largest batch comes first
                order = np.argsort(-lengths, kind="stable")
                starts, lengths = starts[order], lengths[order]
            sets[name] = DocumentPieces(arrays[name], starts, lengths)
        self.train_set, self.val_set = sets["train"], sets["val"]
        self.collate_fn = PadToLongest(self.tokenizer.pad_token_id)

    def _tokenizer(self, train_docs: list[Document], save_dir: Path) -> PreTrainedTokenizerFast:
        cfg = self.tokenizer_cfg
        if cfg.get("path"):
            return load_bpe(str(cfg["path"]))
        if cfg.get("train"):  # the vocabulary never sees the validation text
            return train_bpe(read_lines(train_docs), int(cfg.get("vocab_size", 4096)), save_dir)
        raise RecipeError(f"no tokenizer given: {HOW}")

    def _cache_folder(self, documents: list[Document]) -> Path:
        settings = {
            "format": 1,
            "kind": "documents",  # whole documents, byte-level BPE: not the MLM recipes' token streams
            "source": self.source,
            "val_fraction": self.val_fraction,
            "tokenizer": {k: self.tokenizer_cfg.get(k) for k in ("path", "train", "vocab_size")},
        }
        assert self.cache_dir is not None
        name = f"{self.source}-documents"
        return cache_folder(self.cache_dir, name, settings, documents, self.tokenizer_cfg.get("path"))

    @property
    def lengths(self) -> np.ndarray:
        """Every training sample's tokens, by index (what ``simigrad.lengths`` gives SimiGrad)."""
        self.check_inputs()
        assert isinstance(self.train_set, DocumentPieces)
        return self.train_set.lengths

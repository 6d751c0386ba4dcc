"""``simigrad-prepare-text``: tokenize a text corpus once into token shards on disk, for corpora larger than memory.

    simigrad-prepare-text --files '/data/wiki/*.txt' --tokenizer-path /data/bert-vocab --out /data/wiki-shards
    simigrad-train experiment=bert_large_pretrain data=text_shards data.path=/data/wiki-shards

    simigrad-prepare-text --source stdlib --vocab-size 4096 --no-lowercase --val-fraction 0.03 \\
        --out ~/.cache/lightning-simigrad/stdlib-shards
    simigrad-train experiment=bert_tiny_stdlib_shards

The corpus is read as :class:`~.text.MaskedTextDataModule` reads it with ``split=documents``: the same documents
in the same order, the same split by document name, the same lines and tokenizer calls (the functions of
:mod:`.text`), so the shards hold the token ids it would hold in memory. Here nothing proportional to the corpus is
held: the documents are cut into one contiguous run per worker process and split, and each worker reads its run
line by line and appends every call's token ids to its own shard file. A WordPiece vocabulary, when one is trained,
sees a bounded sample of the training text (``--tokenizer-sample-mb``), so its cost does not grow with the corpus.

What ``--out`` holds, read by :class:`~.text_shards.TokenShardsDataModule` (``data.path``):

- ``tokenizer/``: the tokenizer (``save_pretrained``);
- ``train/NNNNN.bin``, ``val/NNNNN.bin``: raw token ids, uint16 when the vocabulary fits, else int32; one shard per
  worker and split, its documents in corpus order, no special tokens;
- ``index.json``: the format version, the dtype, each shard's token and document counts, the tokenizer settings.
  It is written last and renamed into place, so a folder with an ``index.json`` holds a complete preparation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from lightning_simigrad_recipes.data.text import (
    SOURCES,
    Document,
    corpus_documents,
    describe_corpus,
    encode_lines,
    read_lines,
    split_documents,
)
from lightning_simigrad_recipes.data.tokenizer import build_tokenizer, load_tokenizer
from lightning_simigrad_recipes.errors import RecipeError

FORMAT = 1  # index.json's layout; TokenShardsDataModule refuses another
INDEX = "index.json"
SPLITS = ("train", "val")
MB = 2**20


def shard_dtype(vocab_size: int) -> str:
    """Half the disk and page cache of int32 whenever every id fits in 16 bits (BERT's 30,522 do)."""
    return "uint16" if vocab_size <= 2**16 else "int32"


def _size(doc: Path | str) -> int:
    return doc.stat().st_size if isinstance(doc, Path) else len(doc.encode())


def sample_lines(documents: list[Document], budget: int) -> Iterator[str]:
    """At most about ``budget`` bytes of the documents' lines, taken across all of them: each document gives its
    first lines, in proportion to its size, so the sample sees every part of the corpus and not only its first files.
    A corpus within the budget is given whole, as :class:`~.text.MaskedTextDataModule` trains its vocabulary."""
    sizes = [_size(doc) for _, doc in documents]
    total = sum(sizes)
    for document, size in zip(documents, sizes):
        share = size if total <= budget else budget * size / total
        taken = 0
        with contextlib.closing(read_lines([document])) as lines:  # stop reading a file at its share
            for line in lines:
                if taken >= share:
                    break
                taken += len(line.encode())
                yield line


def partition(documents: list[Document], parts: int) -> list[list[Document]]:
    """Contiguous runs of about equal bytes, in corpus order, so the shards joined in order give the corpus' stream."""
    sizes = [_size(doc) for _, doc in documents]
    total = max(1, sum(sizes))
    runs: list[list[Document]] = [[] for _ in range(parts)]
    start = 0
    for document, size in zip(documents, sizes):
        runs[min(parts - 1, start * parts // total)].append(document)
        start += size
    return [run for run in runs if run]


def write_shard(tokenizer_dir: str, dtype: str, path: Path, documents: list[Document]) -> int:
    """Tokenize ``documents`` into ``path``, appending each tokenizer call's ids as they come; the tokens written."""
    tokenizer = load_tokenizer(tokenizer_dir)
    count = 0
    with path.open("wb") as f:
        for ids in encode_lines(tokenizer, read_lines(documents)):
            ids.astype(dtype).tofile(f)
            count += len(ids)
        f.flush()
        os.fsync(f.fileno())  # on disk before index.json names it: a crash cannot leave an index of lost shards
    return count


def _write_shard_task(numbered: tuple[int, tuple[str, str, Path, list[Document]]]) -> tuple[int, int]:
    number, task = numbered
    return number, write_shard(*task)


def _one_thread_per_worker() -> None:
    # the workers already use the cores; the tokenizer's own thread pool in each would only oversubscribe them
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


class Preparation:
    """One run of the command: the checks on ``--out``, the tokenizer, the shards, then the index."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(os.path.expanduser(args.out))
        self.where = describe_corpus(args.source, args.files, setting="--files")

    def run(self) -> dict[str, Any]:
        """Prepare ``--out``; its index."""
        documents = corpus_documents(self.args.source, self.args.files, setting="--files")
        train_docs, val_docs = split_documents(documents, self.args.val_fraction, self.where, "--val-fraction")
        self._clear()  # only now: a mistyped glob leaves --out as it was
        tokenizer = self._tokenizer(train_docs)
        dtype = shard_dtype(len(tokenizer))
        shards = self._shards({"train": train_docs, "val": val_docs}, dtype)
        index = {
            "format": FORMAT,
            "dtype": dtype,
            "vocab_size": len(tokenizer),
            "tokenizer": self._tokenizer_settings(),
            "corpus": {"source": self.args.source, "files": self.args.files, "val_fraction": self.args.val_fraction},
            "documents": {"train": len(train_docs), "val": len(val_docs)},
            "tokens": {split: sum(s["tokens"] for s in shards[split]) for split in SPLITS},
            "shards": shards,
        }
        scratch = self.out / f".{INDEX}.partial"
        with scratch.open("w") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(scratch, self.out / INDEX)  # last and atomic: a folder with an index is a complete preparation
        return index

    def _clear(self) -> None:
        """Refuse a complete preparation (unless --overwrite); drop the shards of an incomplete one."""
        index = self.out / INDEX
        if index.exists():
            if not self.args.overwrite:
                raise RecipeError(
                    f"--out {self.out} already holds a complete preparation ({INDEX}); give another --out, or add"
                    " --overwrite to replace it"
                )
            index.unlink()  # first: from here on the folder reads as incomplete
        for split in SPLITS:
            (self.out / split).mkdir(parents=True, exist_ok=True)
            for shard in (self.out / split).glob("*.bin"):  # a former run's, possibly of more workers
                shard.unlink()

    def _tokenizer(self, train_docs: list[Document]) -> PreTrainedTokenizerFast:
        args, folder = self.args, self.out / "tokenizer"
        if args.tokenizer_path is None:
            print(
                f"training a WordPiece vocabulary of {args.vocab_size} tokens on at most {args.tokenizer_sample_mb:g}"
                f" MB of the {len(train_docs)} training documents",
                flush=True,
            )
        tokenizer = build_tokenizer(
            path=args.tokenizer_path,
            train=args.tokenizer_path is None,
            vocab_size=args.vocab_size,
            lowercase=args.lowercase,
            texts=sample_lines(train_docs, int(args.tokenizer_sample_mb * MB)),  # never the validation text
            save_dir=folder,
        )
        # the folder is self-contained: the data module loads this copy, whatever becomes of --tokenizer-path
        tokenizer.save_pretrained(str(folder))
        return tokenizer

    def _tokenizer_settings(self) -> dict[str, Any]:
        args = self.args
        if args.tokenizer_path is not None:
            return {"path": str(Path(args.tokenizer_path).expanduser().resolve()), "trained": False}
        return {
            "path": None,
            "trained": True,
            "vocab_size": args.vocab_size,
            "lowercase": args.lowercase,
            "sample_mb": args.tokenizer_sample_mb,
        }

    def _shards(self, splits: dict[str, list[Document]], dtype: str) -> dict[str, list[dict[str, Any]]]:
        """Every split's runs tokenized by ``--workers`` processes (in this one with a single worker)."""
        tokenizer_dir = str(self.out / "tokenizer")
        runs = {split: partition(splits[split], self.args.workers) for split in SPLITS}
        names = [(split, i, run) for split in SPLITS for i, run in enumerate(runs[split])]
        tasks = [(tokenizer_dir, dtype, self.out / split / f"{i:05d}.bin", run) for split, i, run in names]
        print(
            f"tokenizing {len(splits['train'])} training and {len(splits['val'])} validation documents of"
            f" {self.where} into {len(tasks)} shards of {self.out}, {self.args.workers} worker(s)",
            flush=True,
        )
        counts = [0] * len(tasks)
        done: Iterator[tuple[int, int]]
        with contextlib.ExitStack() as stack:
            if self.args.workers == 1:
                done = map(_write_shard_task, enumerate(tasks))
            else:
                # spawn: the workers start clean, without this process' threads (torch's, the tokenizer's) that a
                # fork would copy in an unknown state
                context = multiprocessing.get_context("spawn")
                pool = stack.enter_context(context.Pool(self.args.workers, initializer=_one_thread_per_worker))
                done = pool.imap_unordered(_write_shard_task, enumerate(tasks))
            for number, count in done:
                counts[number] = count
                print(f"  {tasks[number][2].relative_to(self.out)}: {count:,} tokens", flush=True)
        shards: dict[str, list[dict[str, Any]]] = {split: [] for split in SPLITS}
        for (split, i, run), count in zip(names, counts):
            shards[split].append({"file": f"{split}/{i:05d}.bin", "tokens": count, "documents": len(run)})
        return shards


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 1 (exclusive)")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive whole number")
    return value


def _megabytes(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive size")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="simigrad-prepare-text",
        description=(
            "Tokenize a text corpus once into token shards on disk (OUT/train/*.bin, OUT/val/*.bin, OUT/tokenizer/,"
            " OUT/index.json, written last), in parallel processes and without holding the corpus in memory. Train"
            " on them with: simigrad-train experiment=bert_large_pretrain data=text_shards data.path=OUT"
            " (or experiment=bert_tiny_stdlib_shards). The documents, the split and the token ids are those of"
            " data=text with data.split=documents."
        ),
    )
    corpus = p.add_argument_group("corpus")
    corpus.add_argument(
        "--source",
        choices=SOURCES,
        default="files",
        help="files: the --files globs (the default); stdlib: this interpreter's standard library (--files relative to"
        " its folder, installed packages left out); pydoc: CPython's pydoc_data.topics",
    )
    corpus.add_argument(
        "--files",
        nargs="+",
        metavar="GLOB",
        help="UTF-8 text files, quoted globs ('/data/wiki/**/*.txt'); with --source stdlib the default is '**/*.py'",
    )
    corpus.add_argument(
        "--val-fraction",
        type=_fraction,
        default=0.01,
        metavar="F",
        help="share of the documents held out for validation, chosen by a hash of each document's name (default:"
        " %(default)s)",
    )
    tok = p.add_argument_group("tokenizer (the data module loads OUT/tokenizer: none to give at training)")
    tok.add_argument(
        "--tokenizer-path",
        metavar="PATH",
        help="a local folder with vocab.txt (BERT WordPiece) or a tokenizer.json (tokenizer.path of the configs);"
        " without it, a WordPiece vocabulary is trained on the training documents",
    )
    tok.add_argument(
        "--vocab-size",
        type=_count,
        default=30522,
        metavar="N",
        help="tokens of a trained vocabulary (default: %(default)s)",
    )
    tok.add_argument(
        "--lowercase",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lower-case the text for a trained vocabulary (the default; --no-lowercase for source code, cased BERT)",
    )
    tok.add_argument(
        "--tokenizer-sample-mb",
        type=_megabytes,
        default=100.0,
        metavar="MB",
        help="a trained vocabulary sees at most this much of the training text, taken evenly across the documents"
        " (default: %(default)s)",
    )
    run = p.add_argument_group("output")
    run.add_argument("--out", required=True, metavar="OUT", help="the folder to write (data.path at training)")
    run.add_argument(
        "--workers",
        type=_count,
        default=os.cpu_count() or 1,
        metavar="N",
        help="tokenizing processes, each writing one shard per split (1: in this process; default: the %(default)s"
        " CPUs)",
    )
    run.add_argument("--overwrite", action="store_true", help="replace a complete preparation already in OUT")
    return p


def main(argv: list[str] | None = None) -> None:
    """Console entry ``simigrad-prepare-text``; user errors end as one ``error: ...`` line and exit code 2."""
    args = parser().parse_args(argv)
    started = time.perf_counter()
    try:
        index = Preparation(args).run()
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    out = Path(os.path.expanduser(args.out))
    for split in SPLITS:
        print(
            f"{split}: {index['documents'][split]} documents, {index['tokens'][split]:,} tokens"
            f" in {len(index['shards'][split])} shard(s)"
        )
    seconds = time.perf_counter() - started
    print(f"prepared {out} in {seconds:.1f} s ({index['dtype']} token ids, vocabulary of {index['vocab_size']})")
    print(f"train on it: simigrad-train experiment=bert_large_pretrain data=text_shards data.path={out}")


if __name__ == "__main__":
    main()

"""Resident memory of the BERT recipe reading token shards, at 1x and 10x a corpus: flat, the memory maps aside.

    python benchmarks/corpus_memory.py                     # ~4 minutes on 2 CPU cores (twice that when busy)
    python benchmarks/corpus_memory.py --in-memory none    # shards only, ~3.5 minutes
    python benchmarks/corpus_memory.py --in-memory both    # the in-memory module at 10x too: ~7 minutes in all

The corpus is this interpreter's standard library, its ``.py`` files as the ``stdlib`` source reads them
(``sysconfig.get_paths()["stdlib"]``, installed packages left out; ~34 MB), linked into a temporary folder once (1x)
and ten times under distinct folder names (10x). ``simigrad-prepare-text`` prepares both with ``--workers`` processes,
each timed in a process of its own: 1x trains a cased WordPiece vocabulary of 4096 tokens (as
``experiment=bert_tiny_stdlib``), 10x takes the 1x tokenizer by path, so only the tokenizing scales.

Then a fresh process per corpus builds ``TokenShardsDataModule`` (blocks of 128 tokens, batches of 64, no loader
workers), runs ``setup``, iterates ``--batches`` shuffled, masked training batches through its DataLoader and the
whole validation loader, and reads ``--samples`` blocks at random indices across the whole corpus. It reports, from
``/proc/self/status``:

- ``VmHWM``: the peak resident set, file-backed pages included;
- ``RssAnon``: anonymous resident memory (Python objects, arrays, tensors): what has to fit in RAM;
- ``RssFile``: file-backed resident pages (the shared libraries, the memory-mapped shards): page cache, which the
  kernel drops under pressure and reads back on demand.

The in-memory ``MaskedTextDataModule`` (``data=text``, ``split=documents``, the same tokenizer) is measured alike at
1x (``--in-memory both``: at 10x too), for comparison. What still grows with the corpus when reading shards: the
loader's shuffled order (the plain DataLoader here uses torch's ``RandomSampler``, which holds the epoch's
permutation as a Python list, ~36 bytes a block; SimiGrad's sampler, which replaces it in training, holds an int64
tensor, 8 bytes a block), and the shards' pages in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STATUS = ("VmHWM", "RssAnon", "RssFile")
SEQ, BATCH, VAL_FRACTION = 128, 64, 0.03


def status() -> dict[str, float]:
    """This process' ``STATUS`` lines of /proc/self/status, in MiB."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in STATUS:
            found[key] = int(value.split()[0]) / 1024  # kB
    return found


# ---- in the child processes
def child_prepare(spec: dict[str, Any]) -> dict[str, Any]:
    import resource

    from lightning_simigrad_recipes.data.prepare_text import main

    started = time.perf_counter()
    main(spec["argv"])
    return {
        "seconds": time.perf_counter() - started,
        "main": status(),
        "largest_worker_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def child_measure(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    from lightning_simigrad_recipes.data.text import MaskedTextDataModule
    from lightning_simigrad_recipes.data.text_shards import TokenShardsDataModule

    torch.set_num_threads(1)
    stages = {"imports": status()}
    common = {"max_seq_length": SEQ, "batch_size": BATCH, "val_batch_size": 2 * BATCH, "num_workers": 0}
    if spec["kind"] == "shards":
        dm: Any = TokenShardsDataModule(path=spec["path"], **common)
    else:
        dm = MaskedTextDataModule(
            source="files",
            files=spec["files"],
            tokenizer={"path": spec["tokenizer"]},
            split="documents",
            val_fraction=VAL_FRACTION,
            **common,
        )
    started = time.perf_counter()
    dm.setup("fit")
    seconds = time.perf_counter() - started
    stages["setup"] = status()
    for i, _ in enumerate(dm.train_dataloader()):
        if i + 1 == spec["batches"]:
            stages["training"] = status()  # while the loader's iterator, and its shuffled order, are alive
            break
    for _ in dm.val_dataloader():
        pass
    for i in np.random.default_rng(0).integers(0, len(dm.train_set), spec["samples"]):
        dm.train_set[int(i)]
    stages["end"] = status()
    return {"stages": stages, "setup_seconds": seconds, "blocks": [len(dm.train_set), len(dm.val_set)]}


# ---- in the parent
def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` in a fresh interpreter (a clean heap and peak); its result, the last line it prints."""
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['job']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def link_corpus(folder: Path, copies: int) -> str:
    """``copies`` trees of symbolic links to the standard library's .py files; their glob."""
    from lightning_simigrad_recipes.data.text import stdlib_files, stdlib_root

    root = stdlib_root()
    files = stdlib_files("**/*.py")
    for copy in range(copies):
        for path in files:
            link = folder / f"copy{copy:02d}" / path.relative_to(root)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(path)
    return f"{folder}/**/*.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=200, help="training batches of 64 blocks to iterate")
    parser.add_argument("--samples", type=int, default=5000, help="blocks read at random indices")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="simigrad-prepare-text --workers")
    parser.add_argument("--in-memory", choices=("none", "1x", "both"), default="1x", help="measure data=text too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child_prepare(spec) if spec["job"] == "prepare" else child_measure(spec)))
        return

    with tempfile.TemporaryDirectory(prefix="simigrad-corpus-memory-") as tmp:
        work = Path(tmp)
        corpora = {"1x": link_corpus(work / "corpus1", 1), "10x": link_corpus(work / "corpus10", 10)}
        tokenizer = str(work / "shards1x" / "tokenizer")
        tokenizer_args = {"1x": ["--vocab-size", "4096", "--no-lowercase"], "10x": ["--tokenizer-path", tokenizer]}
        prepared, indices, measured = {}, {}, {}
        for scale, files in corpora.items():
            out = work / f"shards{scale}"
            argv = ["--files", files, "--val-fraction", str(VAL_FRACTION), "--workers", str(args.workers)]
            print(f"preparing {scale} ...", flush=True)
            prepared[scale] = run_child({"job": "prepare", "argv": [*argv, *tokenizer_args[scale], "--out", str(out)]})
            indices[scale] = json.loads((out / "index.json").read_text())
        runs = [("shards", scale) for scale in corpora]
        runs += [("in-memory", scale) for scale in {"none": [], "1x": ["1x"], "both": ["1x", "10x"]}[args.in_memory]]
        for kind, scale in runs:
            print(f"measuring {kind} {scale} ...", flush=True)
            spec = {"job": "measure", "kind": kind, "batches": args.batches, "samples": args.samples}
            spec |= {"path": str(work / f"shards{scale}"), "files": corpora[scale], "tokenizer": tokenizer}
            measured[kind, scale] = run_child(spec)
    report(args, prepared, indices, measured)


def report(args: argparse.Namespace, prepared: dict, indices: dict, measured: dict) -> None:
    print(f"\nthe standard library's .py files, {args.workers} preparation worker(s); MiB from /proc/self/status")
    print(
        f"{'corpus':<8}{'train tokens':>14}{'val tokens':>12}{'shards':>8}{'preparation':>13}"
        "   main VmHWM / RssAnon, largest child's VmHWM (its workers)"
    )
    for scale, index in indices.items():
        p = prepared[scale]
        shards = sum(len(s) for s in index["shards"].values())
        peak = f"{p['main']['VmHWM']:.0f} / {p['main']['RssAnon']:.0f}, {p['largest_worker_mib']:.0f}"
        tokens = index["tokens"]
        print(f"{scale:<8}{tokens['train']:>14,}{tokens['val']:>12,}{shards:>8}{p['seconds']:>12.1f}s   {peak}")
    print(
        f"\nafter setup, {args.batches} training batches of {BATCH} x {SEQ} tokens, the validation set and"
        f" {args.samples} random blocks (training blocks + validation blocks; setup in seconds):"
    )
    header = f"{'':<14}{'blocks':>16}{'setup':>8}{'VmHWM':>8}{'RssAnon':>9}{'RssFile':>9}   RssAnon by stage"
    print(f"{header} (imports / setup / training / end)")
    for (kind, scale), m in measured.items():
        final, stages = m["stages"]["end"], m["stages"]
        by_stage = " / ".join(f"{stages[s]['RssAnon']:.0f}" for s in ("imports", "setup", "training", "end"))
        blocks = f"{m['blocks'][0]:,}+{m['blocks'][1]:,}"
        print(
            f"{kind + ' ' + scale:<14}{blocks:>16}{m['setup_seconds']:>7.1f}s{final['VmHWM']:>8.0f}"
            f"{final['RssAnon']:>9.0f}{final['RssFile']:>9.0f}   {by_stage}"
        )
    for kind in ("shards", "in-memory"):
        if (kind, "10x") in measured and (kind, "1x") in measured:
            one, ten = measured[kind, "1x"]["stages"], measured[kind, "10x"]["stages"]
            ratios = [f"VmHWM {ten['end']['VmHWM'] / one['end']['VmHWM']:.2f}"]
            for stage in ("training", "end"):
                a, b = one[stage]["RssAnon"], ten[stage]["RssAnon"]
                ratios.append(f"RssAnon at {stage} {b / a:.2f} ({b - a:+.0f} MiB)")
            print(f"{kind} 10x / 1x: {', '.join(ratios)}")


if __name__ == "__main__":
    main()

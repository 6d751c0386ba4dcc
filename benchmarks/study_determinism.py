"""Same seed, same commit: does the MLM give the same numbers twice, and what moves them?

    python benchmarks/study_determinism.py --out outputs/determinism      # six runs of ~2 minutes, one at a time

The earlier study saw SimiGrad's stdlib MLM rows move on a re-run at the same seeds (5.1944 -> 5.2153 over seeds
0-2) with no cause found. This runs one MLM configuration (``experiment=bert_tiny_stdlib``, the fixed batch B0 = 16
at the recipe's rate, seed 10, validated at the study's 12 points) each time in a fresh process:

- ``as-is`` twice: the same commit, data, tokenizer cache and thread count;
- ``hashseed``: another ``PYTHONHASHSEED`` (the order of Python's sets and string hashes);
- ``threads2``: two intra-op threads instead of one (reductions split differently);
- ``avx2``: ``ATEN_CPU_CAPABILITY=avx2``, the kernels torch runs on a host without AVX-512 (this host has it:
  ``torch.backends.cpu.get_cpu_capability()``); sessions of this project have run on more than one host;
- ``fresh-tokenizer``: an empty ``data.cache_dir``, so the WordPiece vocabulary is trained again and the corpus
  tokenized again; its vocabulary is compared with the cached one.

For each it prints the final validation loss and the first validation at which the curve differs from the first
run's, and writes ``determinism.md``.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

VALIDATION = ["+trainer.val_check_interval=250", "trainer.check_val_every_n_epoch=null"]
BASE = ["experiment=bert_tiny_stdlib", "simigrad=off", "seed=10", "logger=csv", "trainer.enable_progress_bar=false",
        "trainer.enable_checkpointing=false", *VALIDATION]  # fmt: skip
VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "as-is": ({}, ["num_threads=1"]),
    "as-is-again": ({}, ["num_threads=1"]),
    "hashseed": ({"PYTHONHASHSEED": "12345"}, ["num_threads=1"]),
    "threads2": ({}, ["num_threads=2"]),
    "avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, ["num_threads=1"]),
    "fresh-tokenizer": ({}, ["num_threads=1"]),  # data.cache_dir set per run below
}


def curve(run_dir: Path) -> list[float]:
    (metrics,) = run_dir.glob("logs/version_*/metrics.csv")
    with metrics.open() as f:
        return [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]


def cache_files(cache: Path) -> dict[str, str]:
    """SHA-256 of the MLM cache's tokenizer and token ids (``stdlib-<key>/``, the key of the files and settings)."""
    import hashlib

    found = {}
    for name in ("tokenizer/tokenizer.json", "train.npy", "val.npy"):
        for path in sorted(cache.expanduser().glob(f"stdlib-[0-9a-f]*/{name}")):
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/determinism")
    p.add_argument("--only", default=None, help="comma-separated variants (default: all)")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(VARIANTS)
    results: dict[str, tuple[list[float], float]] = {}
    for name in names:
        env_extra, overrides = VARIANTS[name]
        run_dir = out / name
        if not list(run_dir.glob("logs/version_*/metrics.csv")):
            env = {**os.environ, "WANDB_MODE": "disabled", **env_extra}
            extra = [f"output_dir={run_dir}"]
            if name == "fresh-tokenizer":
                extra.append(f"data.cache_dir={out / 'fresh-cache'}")
            start = time.perf_counter()
            cmd = [sys.executable, "-m", "lightning_simigrad_recipes.train", *BASE, *overrides, *extra]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-3000:])
                return 1
            (run_dir / "wall_s.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
        results[name] = (curve(run_dir), float((run_dir / "wall_s.txt").read_text()))
        print(f"{name}: final val/loss {results[name][0][-1]:.6f}", flush=True)
    first = results[names[0]][0]
    lines = ["| run | final val/loss | difference from the first | first validation that differs (of 12) | wall s |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, (values, wall) in results.items():
        differs = next((i + 1 for i, (a, b) in enumerate(zip(first, values)) if a != b), None)
        lines.append(
            f"| {name} | {values[-1]:.6f} | {values[-1] - first[-1]:+.6f} | {differs or 'none'} | {wall:.0f} |"
        )
    if "fresh-tokenizer" in results:
        cached, fresh = cache_files(Path("~/.cache/lightning-simigrad")), cache_files(out / "fresh-cache")
        lines += ["", "The cache built again (fresh-tokenizer) against the cached one, SHA-256 prefixes:", ""]
        for name in sorted(set(cached) | set(fresh)):
            same = "identical" if cached.get(name) == fresh.get(name) else "differs"
            lines.append(f"- `{name}`: {same} ({cached.get(name, '-')} / {fresh.get(name, '-')})")
    text = "\n".join(lines)
    (out / "determinism.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

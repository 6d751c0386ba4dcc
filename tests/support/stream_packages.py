"""The stream packages users train from, over :class:`~tests.support.helpers.IndexedRegression`'s samples: LitData
chunks written by ``litdata.optimize`` (in a process of its own, as LitData runs it), and a Hugging Face
``datasets.IterableDataset`` made offline from a generator. Both yield ``(index, x, y)``."""

from __future__ import annotations

import os
import subprocess
import sys

import lightning.pytorch as pl
import torch

from tests.support.helpers import IndexedRegression

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_OPTIMIZE = """
import sys
from litdata import optimize
from tests.support.stream_packages import Sample
n = int(sys.argv[2])
optimize(fn=Sample(n), inputs=list(range(n)), output_dir=sys.argv[1], chunk_bytes="4kb", num_workers=1)
"""


class Sample:
    """Sample ``i`` of an ``IndexedRegression(n)``, for ``optimize``'s worker processes (which unpickle it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, i: int) -> tuple:
        return IndexedRegression(self.n)[i]


def write_litdata_chunks(output_dir: str, n: int) -> None:
    """``n`` samples optimised into LitData chunks (several, so that ranks and workers each read their own)."""
    subprocess.run([sys.executable, "-c", _OPTIMIZE, output_dir, str(n)], cwd=ROOT, check=True, capture_output=True,
                   timeout=240, env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip


class LitDataModule(pl.LightningDataModule):
    """LitData's loader built in ``train_dataloader``, where LitData's docs build it (the ranks exist by then)."""

    def __init__(self, input_dir: str, batch_size: int = 4, workers: int = 2) -> None:
        super().__init__()
        self.input_dir, self.batch_size, self.workers = input_dir, batch_size, workers

    def train_dataloader(self):
        from litdata import StreamingDataLoader, StreamingDataset

        dataset = StreamingDataset(self.input_dir, shuffle=True, drop_last=False, seed=7)
        return StreamingDataLoader(dataset, batch_size=self.batch_size, num_workers=self.workers)


def hf_stream(n: int, rank: int, world: int, shards: int = 4):
    """A Hugging Face ``IterableDataset`` of ``n`` samples in ``shards`` shards, this rank's part of it."""
    from datasets import IterableDataset
    from datasets.distributed import split_dataset_by_node

    parts = [list(range(n))[s::shards] for s in range(shards)]
    stream = IterableDataset.from_generator(_generate, gen_kwargs={"parts": parts, "n": n})
    if world > 1:
        stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    return stream


def _generate(parts: list[list[int]], n: int):
    """The samples of the shards a worker reads (Hugging Face splits the list of shards among workers)."""
    dataset = IndexedRegression(n)
    for part in parts:
        for i in part:
            j, x, y = dataset[i]
            yield {"index": j, "x": x.tolist(), "y": y.tolist()}


def hf_collate(items: list[dict]) -> tuple:
    """Hugging Face samples collated as the Regressor takes them, ``(index, x, y)``, in float64 as generated (the
    ``torch`` format would make them float32)."""
    index = torch.tensor([item["index"] for item in items])
    x, y = (torch.tensor([item[key] for item in items], dtype=torch.float64) for key in ("x", "y"))
    return index, x, y

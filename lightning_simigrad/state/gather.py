"""Every rank's piece of a checkpoint, gathered to all ranks (Lightning writes the file from rank 0 alone)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["every_rank"]


def every_rank(piece: Any) -> list[Any]:
    """Every rank's ``piece``, in rank order: a collective under ``torch.distributed`` (call it on all ranks).

    ``all_gather_object`` pickles: pieces are plain Python values and bytes (in torch 2.14 it cannot carry tensors).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [piece]
    pieces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, piece)
    return pieces

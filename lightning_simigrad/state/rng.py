"""The random number generator states of every rank, saved in SimiGrad's checkpoint state and restored on resume.

Lightning does not checkpoint random number generators. A model that draws random numbers in its training
step (dropout, noise) therefore resumes on another random stream, its half-batch similarities differ from the
uninterrupted run's, and so do the batch sizes SimiGrad chooses after them. The callback keeps, per rank, the
states of torch's CPU generator, the current CUDA device's, Python's ``random`` and NumPy's global generator,
and puts them back where the uninterrupted run would draw next (see :mod:`lightning_simigrad.state.resume`).

States are kept as bytes and plain Python values: compact, loaded by ``torch.load(weights_only=True)``, and
gathered across ranks by ``all_gather_object`` (which in torch 2.14 cannot carry tensors).
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_ranks_rng_states", "rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's generator states."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": _bytes(torch.get_rng_state()), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _bytes(torch.cuda.get_rng_state())
    try:
        import numpy
    except ImportError:
        return state
    numpy_state: Any = numpy.random.get_state()
    kind, keys, position, has_gauss, cached = numpy_state
    state["numpy"] = [kind, keys.tolist(), position, has_gauss, cached]
    return state


def _bytes(generator_state: torch.Tensor) -> bytes:
    return bytes(generator_state.numpy())


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the generator states :func:`rng_state` returned (those this process has)."""
    torch.set_rng_state(_tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_tensor(state["cuda"]))
    if "numpy" in state:
        import numpy

        kind, keys, position, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), position, has_gauss, cached))


def all_ranks_rng_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``state``, in rank order (a collective under ``torch.distributed``: call it on all ranks)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states

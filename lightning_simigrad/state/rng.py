"""The random number generator states of every rank, saved in SimiGrad's checkpoint state and restored on resume.

Lightning does not checkpoint random number generators. A model that draws random numbers in its training
step (dropout, noise) therefore resumes on another random stream, its half-batch similarities differ from the
uninterrupted run's, and so do the batch sizes SimiGrad chooses after them. The callback keeps, per rank, the
states of torch's CPU generator, the current CUDA device's, Python's ``random`` and NumPy's global generator,
and puts them back where the uninterrupted run would draw next (see :mod:`lightning_simigrad.state.resume`).

States are kept as bytes and plain Python values: compact, loaded by ``torch.load(weights_only=True)``, and
gathered across ranks by :func:`~lightning_simigrad.exchange.gather_objects`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from lightning_simigrad.core.fields import FINITE_NUMBER, NON_NEGATIVE_INT

__all__ = ["RngSnapshot", "check_rng", "rng_state", "set_rng_state"]


class RngSnapshot:
    """The generator states at one moment, copied as the generators hand them out; :meth:`state` turns them into
    the checkpoint's form only when a checkpoint asks.

    The training loop takes one at every window's start, in case a checkpoint is written inside the window, and
    almost none is ever written there: the copies cost some 60 us, the conversion to bytes and lists three times
    that, which a small model's step would pay every time.
    """

    __slots__ = ("_cuda", "_numpy", "_python", "_torch")
    _numpy: Any  # NumPy's legacy state tuple, or None without NumPy

    def __init__(self) -> None:
        self._torch = torch.get_rng_state()  # a copy
        self._python = random.getstate()  # immutable
        # initialized implies available; `is_available` alone costs ~80 us on a CUDA build without a GPU
        self._cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        try:
            import numpy
        except ImportError:
            self._numpy = None
        else:
            self._numpy = numpy.random.get_state()  # holds a copy of the key array

    def state(self) -> dict[str, Any]:
        """The states as :func:`rng_state` returns them."""
        version, internal, gauss = self._python
        state: dict[str, Any] = {"torch": _bytes(self._torch), "python": [version, list(internal), gauss]}
        if self._cuda is not None:
            state["cuda"] = _bytes(self._cuda)
        if self._numpy is not None:
            kind, keys, position, has_gauss, cached = self._numpy
            state["numpy"] = [kind, keys.tolist(), position, has_gauss, cached]
        return state


def rng_state() -> dict[str, Any]:
    """This process's generator states."""
    return RngSnapshot().state()


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


# ------------------------------------------------------------------------------ checks of a restored checkpoint
_non_negative_int, _finite_number = NON_NEGATIVE_INT.check, FINITE_NUMBER.check


def _torch_state_bytes() -> int:
    return int(torch.get_rng_state().numel())


_MT_WORDS = 624  # the Mersenne Twister's state (Python's `random`, NumPy's legacy generator): 624 32-bit words


def _word(value: Any) -> bool:
    return _non_negative_int(value) and value < 2**32


def _python_state(value: Any) -> bool:
    """``[version, internal, gauss]`` as ``random.getstate()`` returns it: 624 words and a position of at most 624."""
    if not (isinstance(value, (list, tuple)) and len(value) == 3):
        return False
    version, internal, gauss = value
    return (
        version == random.getstate()[0]
        and isinstance(internal, (list, tuple))
        and len(internal) == _MT_WORDS + 1
        and all(_word(word) for word in internal)
        and internal[-1] <= _MT_WORDS
        and (gauss is None or isinstance(gauss, float))
    )


def _numpy_state(value: Any) -> bool:
    """``[kind, keys, position, has_gauss, cached_gaussian]`` as ``numpy.random.get_state()`` returns it."""
    if not (isinstance(value, (list, tuple)) and len(value) == 5):
        return False
    kind, keys, position, has_gauss, cached = value
    return (
        kind == "MT19937"
        and isinstance(keys, (list, tuple))
        and len(keys) == _MT_WORDS
        and all(_word(key) for key in keys)
        and _non_negative_int(position)
        and position <= _MT_WORDS
        and has_gauss in (0, 1)
        and _finite_number(cached)
    )


def _bytes_of(length: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, bytes) and len(value) == length


_CUDA_STATE_BYTES = 16  # a CUDA generator's seed and Philox offset


def _rng_fields() -> dict[str, tuple[Callable[[Any], bool], str, str, bool]]:
    """field -> (check, what it holds, what it must be, required), as :func:`lightning_simigrad.state.rng.rng_state`
    writes it."""
    words = f"{_MT_WORDS} ints in [0, 2**32)"
    return {
        "torch": (_bytes_of(_torch_state_bytes()), "torch CPU generator state", f"{_torch_state_bytes()} bytes", True),
        "python": (
            _python_state,
            "Python `random` state",
            f"a list [3, {_MT_WORDS + 1} ints ({words} and a position of at most {_MT_WORDS}), None or a float]",
            True,
        ),
        "cuda": (_bytes_of(_CUDA_STATE_BYTES), "CUDA generator state", f"{_CUDA_STATE_BYTES} bytes", False),
        "numpy": (
            _numpy_state,
            "NumPy global generator state",
            f"a list ['MT19937', {words}, a position of at most {_MT_WORDS}, 0 or 1, a finite float]",
            False,
        ),
    }


def _short(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({len(value)} bytes)" if isinstance(value, bytes) else text


def check_rng(rng: Any, prefix: str) -> None:
    """Every rank's random generator states are whole: restoring them cannot fail in the middle of training."""
    fix = (
        "The file is damaged or was edited. Delete the `rng` entry to resume without restoring the random generator"
        " states, or resume from another checkpoint."
    )
    if not isinstance(rng, list):
        raise ValueError(f"{prefix} has `rng` = {_short(rng)}, which must be a list of every rank's states. {fix}")
    fields = _rng_fields()
    for rank, entry in enumerate(rng):
        if not isinstance(entry, dict):
            raise ValueError(
                f"{prefix} has `rng[{rank}]` = {_short(entry)}: rank {rank}'s random generator states must be a dict."
                f" {fix}"
            )
        for name, (check, what, expected, required) in fields.items():
            if name not in entry:
                if required:
                    raise ValueError(f"{prefix} lacks `rng[{rank}].{name}`, rank {rank}'s {what}. {fix}")
                continue
            if not check(entry[name]):
                raise ValueError(
                    f"{prefix} has `rng[{rank}].{name}` = {_short(entry[name])}: rank {rank}'s {what} must be"
                    f" {expected}. {fix}"
                )

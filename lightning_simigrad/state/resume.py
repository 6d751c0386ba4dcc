"""Where a resumed fit stands, as named stages, and what it restores there.

Lightning does not checkpoint random number generators, and it cannot say which samples of an epoch a
checkpoint written in its middle had trained. SimiGrad's state (:mod:`lightning_simigrad.state.checkpoint`)
records both; a resumed fit then passes through these stages:

========================  =========================================================================
stage                     what is still to do
========================  =========================================================================
``FRESH``                 nothing: no checkpoint, or one whose generators are not restored here
``WITHOUT_STATE``         nothing: the checkpoint had no SimiGrad state; SimiGrad starts at B0
``RNG_AT_FIRST_BATCH``    written inside an epoch: the generators go back at the first training batch,
                          where the uninterrupted run drew next
``RNG_BEFORE_EPOCH``      written at an epoch's end: the generators go back before the next epoch's
                          data iterator is made (its shuffling seed is drawn then), and again if
                          Lightning makes that iterator once more
``RESTORED``              the generators are back; the fit runs on as the uninterrupted one did
========================  =========================================================================

:class:`Restart` is the one resume type: the checkpoint's SimiGrad state, read
(:class:`~lightning_simigrad.state.checkpoint.Saved`), what Lightning says about the checkpoint (read by the
integration layer, so that this module and :class:`~lightning_simigrad.run.Run` never touch Lightning), and, once
:meth:`Restart.placed`, where the resumed fit stands in the data's epoch (or a refusal of what cannot be resumed
exactly). Every component then takes its own piece of the checkpoint back (:func:`lightning_simigrad.run.restore`);
the generators wait in a :class:`Resumption` for the stage where they go back.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from lightning_simigrad.core.sample_counts import Data
from lightning_simigrad.state.checkpoint import Saved
from lightning_simigrad.state.rng import rng_state, set_rng_state

__all__ = ["Restart", "Resumption", "Stage", "generators_of", "outside_bounds", "without_state"]


class Stage(enum.Enum):
    FRESH = "fresh"
    WITHOUT_STATE = "without_state"
    RNG_AT_FIRST_BATCH = "rng_at_first_batch"
    RNG_BEFORE_EPOCH = "rng_before_epoch"
    RESTORED = "restored"


@dataclass(frozen=True)
class Restart:
    """A checkpoint being resumed: SimiGrad's state in it, what Lightning says of it, and, once placed
    (:meth:`placed`), where it leaves the data's epoch.

    Args:
        path: the checkpoint, for messages.
        state: SimiGrad's state in it (validated; a dict is read into a
            :class:`~lightning_simigrad.state.checkpoint.Saved`), or None when it has none.
        epoch: the epoch Lightning trains first (what samplers' ``set_epoch`` receive).
        at_epoch_end: it was written after its epoch's last batch (Lightning then trains the next epoch).
        batches_into_epoch: micro-batches of the epoch it was written in that had run (0 at an epoch's start, and where
            Lightning starts a new epoch).
        global_step: optimizer steps it counted.
        same_epoch: placed: the fit resumes inside the data's epoch the checkpoint was written in.
        samples_done: placed: that epoch's committed samples (the sampler skips them), 0 unless the fit resumes inside.
        epoch_offset: placed: the training loop's epoch count less the data's, from now on.
    """

    path: str
    state: Saved | None
    epoch: int
    at_epoch_end: bool
    batches_into_epoch: int
    global_step: int
    same_epoch: bool = False
    samples_done: int = 0
    epoch_offset: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.state, Mapping):
            object.__setattr__(self, "state", Saved.of(self.state))

    @property
    def saved(self) -> Saved:
        """The checkpoint's SimiGrad state (only for a checkpoint that has one)."""
        assert self.state is not None
        return self.state

    def placed(self, data: Data, world_size: int, warn: Callable[[str], None]) -> Restart:
        """Where the checkpoint leaves the data's epoch, or a refusal of a resume that cannot be exact.

        The training loop's epoch and the data's part ways where ``max_steps`` stops a fit inside an epoch: Lightning
        counts that epoch as done when the fit stops, and a fit resumed with a larger ``max_steps`` finishes its data
        as the loop's next epoch (with ``max_steps=-1`` it starts the next epoch instead, and so does SimiGrad).

        Raises:
            ValueError: the checkpoint was written in the middle of an epoch of a training set of another size.
        """
        saved = self.saved
        epoch, done, offset = saved.schedule.epoch, saved.counts.epoch_samples_done, saved.schedule.epoch_offset
        if self.batches_into_epoch > 0 and self.epoch - offset == epoch + 1:
            offset += 1  # stopped inside the epoch, which the loop counts as done: it finishes it as its next one
        # a checkpoint written at the epoch's last batch ends it: Lightning then trains the next epoch
        same_epoch = epoch == self.epoch - offset and not self.at_epoch_end
        length = saved.facts.epoch_length
        if not same_epoch and not self.at_epoch_end and epoch + 1 == self.epoch - offset:
            _tell_what_a_new_epoch_leaves(self, done, length, warn)
        if same_epoch and done > 0 and length != data.epoch_length:
            raise ValueError(
                f"The checkpoint {self.path} was written {done} samples into epoch {epoch} of a training set of"
                f" {length} samples; this fit's training set has {data.epoch_length}, so the rest of that epoch cannot"
                " be identified. Resume with the same training data, or from a checkpoint written at the end of an"
                " epoch."
            )
        if same_epoch and (done > 0 or saved.schedule.planned) and world_size == 1 and not data.regenerable_order:
            warn(_an_order_drawn_again(self.path, epoch, done, data))  # (under DDP the sampler refuses such an order)
        return replace(self, same_epoch=same_epoch, samples_done=done if same_epoch else 0, epoch_offset=offset)


def _tell_what_a_new_epoch_leaves(restart: Restart, done: int, length: int | None, warn: Callable[[str], None]) -> None:
    """Lightning starts the epoch after the checkpoint's, which ``max_steps`` had stopped: say what is left."""
    epoch = restart.saved.schedule.epoch
    if done > 0 and (length is None or done < length):
        warn(
            f"The checkpoint {restart.path} was written {done} samples into epoch {epoch}, where `max_steps` stopped"
            f" the fit, and Lightning counts that epoch as done: resumed with `max_steps=-1`, it starts the next"
            f" epoch, and the rest of epoch {epoch} is not trained (as in plain Lightning). Resume with a larger"
            " `max_steps` to finish it first."
        )


def _an_order_drawn_again(path: str, epoch: int, done: int, data: Data) -> str:
    return (
        f"The checkpoint {path} was written in the middle of epoch {epoch}, and the training DataLoader's"
        f" `{data.sampler}` has an order SimiGrad cannot regenerate (only a RandomSampler without replacement and a"
        " SequentialSampler have one): the rest of the epoch is taken from a new draw of that order, past its first"
        f" {done} samples, not from the order the interrupted run was following. Unless the sampler yields the same"
        f" order every time, the resumed run trains other samples in epoch {epoch} than the uninterrupted run."
        " Resume from a checkpoint written at an epoch's end for an exact resume."
    )


class Resumption:
    """The stage a fit stands at, with this rank's generator states from the checkpoint while they wait."""

    def __init__(self, stage: Stage = Stage.FRESH, states: dict[str, Any] | None = None) -> None:
        if (states is not None) != (stage in _WAITING):
            raise ValueError(f"the stage {stage.name} {'takes no' if states is not None else 'needs'} generator states")
        self.stage = stage
        self.states = states
        self.before_epoch()  # Lightning makes the data iterator right after the data is loaded

    def before_epoch(self) -> None:
        """A new epoch's data iterator is about to be made."""
        if self.stage is Stage.RNG_BEFORE_EPOCH and self.states is not None:
            set_rng_state(self.states)

    def at_first_batch(self) -> None:
        """The fit's first training batch is about to run."""
        if self.stage is Stage.RNG_AT_FIRST_BATCH and self.states is not None:
            set_rng_state(self.states)
        if self.stage in _WAITING:
            self.stage, self.states = Stage.RESTORED, None

    def to_save(self, window_start: dict[str, Any] | None) -> dict[str, Any]:
        """The states a checkpoint written now records: those still waiting for the first batch, else those at
        the start of the window being trained (``window_start``, which a resume trains again), else the current."""
        if self.stage is Stage.RNG_AT_FIRST_BATCH and self.states is not None:
            return self.states
        return window_start if window_start is not None else rng_state()

    def forget(self) -> None:
        """Drop the states that wait to be restored (a fit that ended before its first batch never restores them)."""
        if self.stage in _WAITING:
            self.stage, self.states = Stage.FRESH, None


_WAITING = (Stage.RNG_AT_FIRST_BATCH, Stage.RNG_BEFORE_EPOCH)


def generators_of(restart: Restart, world_size: int, rank: int) -> Resumption:
    """This rank's generator states from the (placed) checkpoint, waiting for the stage where they go back."""
    states = restart.saved.generators
    if states is None or len(states) != world_size:  # on other ranks, their streams start anew
        return Resumption()
    return Resumption(Stage.RNG_AT_FIRST_BATCH if restart.same_epoch else Stage.RNG_BEFORE_EPOCH, states[rank])


def without_state(restart: Restart) -> str:
    """What a resume from a checkpoint written without SimiGrad does, in words."""
    message = (
        f"The checkpoint {restart.path} has no SimiGrad state (it was written by a fit without the SimiGrad"
        " callback): SimiGrad starts again at the initial batch size B0 with a new controller, counting the"
        " checkpoint's steps as steps of B0 samples."
    )
    if restart.batches_into_epoch > 0:
        message += (
            f" It was written {restart.batches_into_epoch} batches into epoch {restart.epoch}, and nothing in it"
            f" says which samples they held: epoch {restart.epoch} restarts from its first sample, so those batches'"
            " samples are trained again (plain Lightning, too, restarts a DataLoader that cannot resume from its"
            " first sample). Resume from a checkpoint written at an epoch's end to avoid it."
        )
    return message


def outside_bounds(
    restart: Restart,
    asked: tuple[int, list[int]],
    brought: tuple[int, list[int]],
    bounds: tuple[int, int | None],
    need: int,
    world_size: int,
) -> str:
    """The warning for a checkpoint whose batch size (and planned windows) ``asked`` lie outside this fit's
    ``bounds``, brought within them as ``brought``; ``need`` samples are what a measurement needs."""
    low, high = bounds
    return (
        f"The checkpoint {restart.path} asks for batch sizes outside this fit's bounds, {low} to"
        f" {'any size' if high is None else high} (`min_batch_size` and `max_batch_size`, and at least the"
        f" {need} samples a measurement needs on {world_size} rank(s)): its batch size {asked[0]} and the windows it"
        f" had planned, {asked[1]}, are brought within them ({brought[0]}, {brought[1]}). The resumed run therefore"
        " differs from the uninterrupted one from its first step."
    )

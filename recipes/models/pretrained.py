"""``model.init_from``: a BERT's weights from a masked-LM pretraining checkpoint of these recipes.

One loader serves both places a run starts from an earlier one: phase 2 of pretraining (``MaskedLM``: the encoder
and the masked-LM head of phase 1) and SQuAD fine-tuning (``QuestionAnswering``: the encoder alone; the span head
starts fresh). Only weights are read: the run builds its own optimizer, schedule and SimiGrad state.

A checkpoint is the ``.ckpt`` Lightning wrote for ``recipes/models/masked_lm.py`` (``state_dict`` keys
``bert.bert.*``, ``bert.cls.*``), or a file holding a ``BertForMaskedLM`` state dict (``bert.*``, ``cls.*``), bare
or under ``state_dict``. It is read with ``torch.load(weights_only=True)``, which runs no code from the file. A
checkpoint whose tensors differ from the model's in any name or shape (other sizes, another vocabulary) is refused
before training, naming both sets of sizes.
"""

from __future__ import annotations

import contextlib
import typing
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import nn

from lightning_simigrad_recipes.errors import RecipeError

# Where a BertFor* model's keys start in a checkpoint: MaskedLM's Lightning state dict (its `bert` attribute), then
# a BertForMaskedLM state dict saved by itself.
ROOTS = ("bert.", "")
HOW = (
    "give the .ckpt file a masked-LM pretraining run of these recipes wrote "
    "(experiment=bert_large_pretrain or bert_large_phase2; `find <its run dir> -name '*.ckpt'`)"
)


def _checkpoint_globals() -> list[Any]:
    """What a Lightning checkpoint of a Hydra-configured run holds besides tensors and plain containers.

    The optimizer's state keeps its hyperparameters as the config gave them (``betas`` as an omegaconf ``ListConfig``);
    these types are allowed to ``torch.load(weights_only=True)``, which refuses any other code.
    """
    from omegaconf import DictConfig, ListConfig
    from omegaconf.base import ContainerMetadata, Metadata
    from omegaconf.nodes import AnyNode

    omegaconf = [ListConfig, DictConfig, ContainerMetadata, Metadata, AnyNode]
    return [*omegaconf, typing.Any, list, dict, int, float, defaultdict]


@rank_zero_only
def _print(message: str) -> None:
    print(message)


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The state dict of the checkpoint at ``path`` (a Lightning ``.ckpt``, or a bare or wrapped state dict).

    Raises:
        RecipeError: no such file, a folder (a sharded checkpoint), not a PyTorch file of tensors, no state dict.
    """
    file = Path(path).expanduser()
    if file.is_dir():
        raise RecipeError(
            f"model.init_from={path} is a folder (a sharded trainer=fsdp checkpoint?); consolidate it into one file"
            f" first: python -m lightning.pytorch.utilities.consolidate_checkpoint {path}"
        )
    if not file.is_file():
        raise RecipeError(f"model.init_from={path} does not exist; {HOW}")
    allow = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5
    try:
        with allow(_checkpoint_globals()) if allow else contextlib.nullcontext():
            checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and torch errors alike
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecipeError(
            f"model.init_from={path} could not be read as a PyTorch checkpoint of tensors ({first_line}); {HOW}, or a"
            " file of its weights alone: torch.save({'state_dict': checkpoint['state_dict']}, 'weights.pt')"
        ) from None
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RecipeError(f"model.init_from={path} holds no state dict of tensors; {HOW}")
    return state


def _shape_summary(state: dict[str, torch.Tensor]) -> str:
    """The sizes a BERT encoder's tensors (``embeddings.*``, ``encoder.*``) reveal."""

    def size(key: str, dim: int) -> Any:
        return state[key].shape[dim] if key in state else "?"

    layers = {key.split(".")[2] for key in state if key.startswith("encoder.layer.")}
    return (
        f"vocab_size {size('embeddings.word_embeddings.weight', 0)},"
        f" hidden_size {size('embeddings.word_embeddings.weight', 1)},"
        f" num_hidden_layers {len(layers)},"
        f" intermediate_size {size('encoder.layer.0.intermediate.dense.weight', 0)},"
        f" max_position_embeddings {size('embeddings.position_embeddings.weight', 0)}"
    )


def _mismatch(part: str, saved: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> list[str]:
    """What keeps ``saved`` from loading into ``target`` strictly, one phrase per kind of difference."""
    missing = sorted(set(target) - set(saved))
    unexpected = sorted(set(saved) - set(target))
    mismatched = sorted(k for k in set(target) & set(saved) if target[k].shape != saved[k].shape)
    problems = []
    if mismatched:
        key = mismatched[0]
        problems.append(
            f"{len(mismatched)} tensors of other shapes, e.g. {part}.{key}: checkpoint {tuple(saved[key].shape)},"
            f" model {tuple(target[key].shape)}"
        )
    if missing:
        problems.append(f"{len(missing)} of the model's tensors absent, e.g. {part}.{missing[0]}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensors the model lacks, e.g. {part}.{unexpected[0]}")
    return problems


def load_pretrained(model: nn.Module, path: str, parts: Sequence[str] = ("bert",)) -> dict[str, list[str]]:
    """Copy the submodules ``parts`` of a ``BertFor*`` model (``bert``: the encoder; ``cls``: the masked-LM head)
    from the pretraining checkpoint at ``path``; the model's other tensors keep their fresh initialization.

    Returns:
        ``{"loaded": [...], "fresh": [...], "dropped": [...]}``: the keys of ``model`` copied from the checkpoint,
        its keys left as initialized (``qa_outputs.*``, SQuAD's span head), and the checkpoint's keys not used
        (``bert.cls.*``, the masked-LM head, when only the encoder is loaded).

    Raises:
        RecipeError: the file cannot be read (:func:`read_state_dict`), lacks a part, or a part differs in a tensor's
            name or shape.
    """
    state = read_state_dict(path)
    root = next((r for r in ROOTS if any(k.startswith(f"{r}bert.embeddings.") for k in state)), None)
    if root is None:
        raise RecipeError(f"model.init_from={path} holds no BERT encoder (no bert.bert.embeddings.* tensors); {HOW}")

    def under(part: str) -> dict[str, torch.Tensor]:
        prefix = f"{root}{part}."
        return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}

    saved_parts = {part: under(part) for part in parts}
    empty = [part for part, saved in saved_parts.items() if not saved]
    if empty:
        raise RecipeError(
            f"model.init_from={path} holds no {root}{empty[0]}.* tensors, which this model starts from (phase 2"
            f" continues a masked-LM run: its encoder and its masked-LM head); {HOW}"
        )
    problems = [p for part in parts for p in _mismatch(part, saved_parts[part], getattr(model, part).state_dict())]
    if problems:
        raise RecipeError(
            f"model.init_from={path}: its BERT does not match this model ({'; '.join(problems)})."
            f" The checkpoint has {_shape_summary(under('bert'))}; the model has"
            f" {_shape_summary(model.bert.state_dict())}. Start from it with the pretraining run's model.config (the"
            " same sizes, e.g. model.config.hidden_size=...) and its tokenizer (tokenizer.path=<its run dir>/tokenizer"
            " or the vocab.txt it used), whose vocabulary sets the embeddings"
        )
    loaded: list[str] = []
    for part in parts:
        getattr(model, part).load_state_dict(saved_parts[part], strict=True)
        loaded += [f"{part}.{key}" for key in saved_parts[part]]
    used = tuple(f"{root}{part}." for part in parts)
    report = {
        "loaded": sorted(loaded),
        "fresh": sorted(set(model.state_dict()) - set(loaded)),
        "dropped": sorted(key for key in state if not key.startswith(used)),
    }
    dropped_groups = sorted({".".join(k.split(".")[:2]) + ".*" for k in report["dropped"]})
    _print(
        f"model.init_from={path}: loaded {len(loaded)} tensors into {', '.join(f'{p}.*' for p in parts)};"
        f" initialised fresh: {', '.join(report['fresh']) or 'nothing'}; dropped {len(report['dropped'])} tensors"
        f" not part of this model ({', '.join(dropped_groups) or 'none'})"
    )
    return report

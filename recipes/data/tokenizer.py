"""The BERT tokenizer of the MLM recipes: loaded from a local path, or trained here with ``tokenizers``."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from tokenizers import BertWordPieceTokenizer
from transformers import BertTokenizerFast, PreTrainedTokenizerFast

from lightning_simigrad_recipes.errors import RecipeError

SPECIAL_TOKENS = {
    "unk_token": "[UNK]",
    "sep_token": "[SEP]",
    "pad_token": "[PAD]",
    "cls_token": "[CLS]",
    "mask_token": "[MASK]",
}
HOW = (
    "set tokenizer.path to a folder with vocab.txt (BERT WordPiece) or a tokenizer.json, "
    "or set tokenizer.train=true to train a WordPiece vocabulary on the corpus"
)


def _from_vocab(vocab_file: Path, lowercase: bool | None = None) -> PreTrainedTokenizerFast:
    """A BERT WordPiece tokenizer from ``vocab.txt``, read through its folder, offline.

    (``BertTokenizerFast(vocab_file=...)`` silently ignores the file in transformers 5, whose argument is
    ``vocab``; ``from_pretrained`` on the folder works in 4.x and 5.x alike.)
    """
    if vocab_file.name != "vocab.txt":
        raise RecipeError(f"{vocab_file}: a WordPiece vocabulary must be named vocab.txt; {HOW}")
    kwargs = {} if lowercase is None else {"do_lower_case": lowercase}
    return BertTokenizerFast.from_pretrained(str(vocab_file.parent), local_files_only=True, **kwargs)


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Load a local tokenizer: a ``vocab.txt`` folder or file, a ``tokenizer.json`` folder or file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise RecipeError(f"tokenizer.path={path} does not exist; {HOW}")
    json_file = p if p.is_file() and p.suffix == ".json" else p / "tokenizer.json"
    vocab_file = p if p.is_file() and p.suffix == ".txt" else p / "vocab.txt"
    try:
        if json_file.is_file():
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(json_file), **SPECIAL_TOKENS)
        elif vocab_file.is_file():
            tokenizer = _from_vocab(vocab_file)
        else:
            raise RecipeError(f"tokenizer.path={path} holds neither vocab.txt nor tokenizer.json; {HOW}")
    except (OSError, ValueError, Exception) as err:  # tokenizers raises its own Exception subclass
        if isinstance(err, RecipeError):
            raise
        raise RecipeError(f"tokenizer.path={path} could not be read ({err}); {HOW}") from None
    if len(tokenizer) <= len(SPECIAL_TOKENS):
        raise RecipeError(f"the tokenizer at {path} holds only {len(tokenizer)} tokens; {HOW}")
    if tokenizer.mask_token_id is None or tokenizer.mask_token_id == tokenizer.unk_token_id:
        raise RecipeError(f"the tokenizer at {path} has no [MASK] token, which masked-LM pretraining needs")
    return tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int, lowercase: bool, save_dir: Path) -> PreTrainedTokenizerFast:
    """Train a BERT WordPiece vocabulary on ``texts`` and save it as ``save_dir/vocab.txt``.

    The saved folder can be passed back as ``tokenizer.path`` to skip training next time. Under DDP
    every process trains the same vocabulary (deterministic); only local rank 0 writes ``save_dir``.
    """
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        save_dir = Path(tempfile.mkdtemp(prefix="simigrad-tokenizer-"))
    wordpiece = BertWordPieceTokenizer(lowercase=lowercase)
    wordpiece.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS.values())
    )
    save_dir.mkdir(parents=True, exist_ok=True)
    wordpiece.save_model(str(save_dir))
    return _from_vocab(save_dir / "vocab.txt", lowercase=lowercase)


def build_tokenizer(
    path: str | None, train: bool, vocab_size: int, lowercase: bool, texts: Iterable[str], save_dir: Path
) -> PreTrainedTokenizerFast:
    """``tokenizer.path`` wins; otherwise train one if ``tokenizer.train`` is set; otherwise explain."""
    if path:
        return load_tokenizer(path)
    if train:
        return train_tokenizer(texts, vocab_size, lowercase, save_dir)
    raise RecipeError(f"no tokenizer given: {HOW}")

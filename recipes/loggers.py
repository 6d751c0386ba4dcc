"""Logger factories: W&B that goes offline by itself when no credentials are present."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info


def wandb_has_credentials() -> bool:
    """True if ``WANDB_API_KEY`` is set or ``wandb login`` left an entry in the netrc file."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_logger(mode: str = "auto", save_dir: str | None = None, **kwargs: Any) -> WandbLogger:
    """A ``WandbLogger``; ``mode="auto"`` is online with credentials and offline without.

    ``WANDB_MODE`` in the environment wins over ``auto``. Offline runs are synced later with
    ``wandb sync <save_dir>/wandb/offline-run-*``.

    Args:
        mode: ``"auto"``, ``"online"``, ``"offline"`` or ``"disabled"``.
        save_dir: where the ``wandb/`` folder goes (the recipe passes its run directory).
        **kwargs: passed to ``WandbLogger`` and on to ``wandb.init`` (project, group, name, tags...).
    """
    if mode == "auto":
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_has_credentials() else "offline")
        if mode == "offline":
            rank_zero_info(f"W&B: no API key found, logging offline under {save_dir} (`wandb sync` it later)")
    return WandbLogger(save_dir=save_dir, mode=mode, **kwargs)

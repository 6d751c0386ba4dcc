"""Hydra recipes for ``lightning_simigrad``: the paper's experiments and small embedded defaults.

Run them with the ``simigrad-train`` console script (``recipes.train:main``); the configs live in
``conf/`` at the repository root. This package imports Hydra, torchvision, transformers and wandb
(the ``recipes`` extra); the library ``lightning_simigrad`` itself does not.
"""

from recipes.errors import RecipeError

__all__ = ["RecipeError"]

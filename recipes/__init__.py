"""Hydra recipes for ``lightning_simigrad``: the paper's experiments and small embedded defaults.

Run them with the ``simigrad-train`` console script (``lightning_simigrad_recipes.train:main``). The
repository keeps this package in ``recipes/`` and its Hydra configs in ``conf/``; installed, they are
``lightning_simigrad_recipes`` and ``lightning_simigrad_recipes.conf`` (``setup.py`` maps the folders).
This package imports Hydra, torchvision, transformers and wandb (the ``recipes`` extra); the library
``lightning_simigrad`` never imports it.
"""

from lightning_simigrad_recipes.errors import RecipeError

__all__ = ["RecipeError"]

"""The recipes' Hydra configs, installed as the package ``lightning_simigrad_recipes.conf``.

Hydra's ``pkg://`` search path only reads a config folder that is an importable package, hence this file.
"""

"""Package layout, which pyproject.toml cannot express: the repository keeps its readable top-level folders,
the wheel installs them under names of our own.

- ``lightning_simigrad/`` -> ``lightning_simigrad`` (the library);
- ``recipes/``            -> ``lightning_simigrad_recipes`` (the recipes' code; ``recipes`` is too generic a
  top-level name to install, other distributions use it too);
- ``conf/``               -> ``lightning_simigrad_recipes.conf`` (the Hydra configs, which ``simigrad-train``
  reads through the ``pkg://lightning_simigrad_recipes.conf`` search path, installed or editable alike).

Subpackages and config files are discovered, never listed, so a new module under ``recipes/`` or a new
``.yaml`` under ``conf/`` ships without editing this file. Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

RECIPES = "lightning_simigrad_recipes"

setup(
    package_dir={RECIPES: "recipes", f"{RECIPES}.conf": "conf"},
    packages=[
        *find_packages(include=["lightning_simigrad", "lightning_simigrad.*"]),
        *(RECIPES + name.removeprefix("recipes") for name in find_packages(include=["recipes", "recipes.*"])),
        f"{RECIPES}.conf",
    ],
    # conf/'s groups are folders of YAML files, shipped as data of the one package conf/ is
    package_data={"lightning_simigrad": ["py.typed"], f"{RECIPES}.conf": ["**/*.yaml"]},
)

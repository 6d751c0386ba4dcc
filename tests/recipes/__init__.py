"""The recipes (``lightning_simigrad_recipes``), their command line, and the efficiency study that runs them."""

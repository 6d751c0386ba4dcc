"""LightningModules and small network builders of the recipes."""

"""The state: what a checkpoint carries, resuming from it, the random generators."""

"""The measurements, each through its protocol: one process, DDP rank groups (gloo), FSDP shards."""

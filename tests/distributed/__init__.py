"""Several processes: DDP, FSDP, two nodes, faults and restarts under torchrun, resumes on other world sizes."""

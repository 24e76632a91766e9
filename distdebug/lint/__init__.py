"""Configuration pitfalls of DDP, FSDP and DeepSpeed (static: from the source)."""

"""Prints what --deterministic should have set up before the script's first line (no seeding here)."""

import random

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} deterministic={torch.are_deterministic_algorithms_enabled()} "
      f"torch={torch.rand(1).item():.6f} random={random.random():.6f}", flush=True)
dist.destroy_process_group()

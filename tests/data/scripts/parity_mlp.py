"""The same training at any number of ranks, for ``distdebug parity``: each step's global batch is drawn from one
seeded generator and split between the ranks (rank r takes its r-th slice), the model is built from one seed and
wrapped in DDP, the loss is each rank's mean: N ranks compute what 1 rank computes, up to the order of sums.

``--fsdp2``: the model sharded by FSDP2 instead of replicated by DDP (the same averaged gradients).
``--sum-grads``: the loss multiplied by the world size (what a script that all-reduces with SUM and never
divides does): every gradient is N times the reference's from step 1.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--sum-grads", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="the model's and the data's seed")
    p.add_argument("--fsdp2", action="store_true", help="shard the model with FSDP2 (fully_shard) instead of DDP")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    if args.fsdp2:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    else:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_rank = args.global_batch // world
    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(1000 * (args.seed + 1) + step)
        x = torch.randn(args.global_batch, 16, generator=g)
        y = torch.randn(args.global_batch, 4, generator=g)
        xb, yb = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        if args.sum_grads:
            loss = loss * world
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

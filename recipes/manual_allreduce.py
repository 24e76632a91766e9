"""Hand-written data parallelism: a plain MLP whose gradients the loop all-reduces itself (no wrapper).

The shape of many research loops and of a first debugging stage. Nothing broadcasts the
initial parameters here, so every rank must seed alike; DistributedSampler shards the data.

    distdebug attach recipes/manual_allreduce.py --steps 20
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import StepTimer, base_parser, finish, param_digest, setup, share, write_digest  # noqa: E402


def synthetic_regression(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed + 2000)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g))


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], global_batch=True).parse_args()
    device = setup(args.seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    world = dist.get_world_size()
    # --global-batch G: one data set of 32 G samples at any world size that divides G (no padding); DistributedSampler
    # deals its permutation out in turn, so the ranks' i-th batches together are the 1-rank run's i-th batch
    data = synthetic_regression(64 * world * 4 if args.global_batch is None else 32 * args.global_batch, args.seed)
    sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=share(args, world), sampler=sampler)
    step, epoch, loss = 0, 0, torch.tensor(0.0)
    timer = StepTimer()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            for p in model.parameters():  # the hand-written gradient average
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            opt.zero_grad(set_to_none=True)
            timer.tick()
            step += 1
            if step >= args.steps:
                break
        epoch += 1
    write_digest(args.digest_out, param_digest(model.named_parameters()), float(loss.detach()), timer)
    finish()


if __name__ == "__main__":
    main()

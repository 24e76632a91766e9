"""A small ResNet-style image classifier trained the usual way, under DDP: residual blocks with BatchNorm,
SGD with momentum 0.9 and lr 0.1, weight decay, cross-entropy on synthetic images labelled by a fixed random
teacher (so the loss falls as a classifier's does). Its gradient norm bumps early (it doubled at step 11 of
one seed in bench/loss_traces.py, which records this model's curves): what loss_spike must not call a spike.

``build(seed)`` and ``batches(seed)`` are shared with bench/loss_traces.py (one process per seed there).
"""

import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.na, self.nb = nn.BatchNorm2d(c), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.nb(self.b(F.relu(self.na(self.a(x))))))


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                          Block(16), Block(16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    return model, opt


def batches(seed: int, batch: int = 32, rank: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Images and their teacher's labels, forever: the teacher is the seed's, the images each rank's own
    (rank 0's are the ones bench/loss_traces.py records)."""
    g = torch.Generator().manual_seed(1000 + seed)
    teacher = torch.randn(3 * 16 * 16, 10, generator=g)
    if rank:
        g.manual_seed(1000 + seed + 7919 * rank)
    while True:
        x = torch.randn(batch, 3, 16, 16, generator=g)
        yield x, (x.flatten(1) @ teacher).argmax(1)


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    from recipes._common import base_parser, finish, param_digest, setup, write_digest

    p = base_parser(__doc__)
    p.set_defaults(steps=30, batch_size=32)
    args = p.parse_args()
    setup(args.seed)
    rank = dist.get_rank()
    model, opt = build(args.seed)
    ddp = DDP(model)
    data = batches(args.seed, args.batch_size, rank)
    loss = torch.zeros(())
    for _ in range(args.steps):
        x, y = next(data)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    write_digest(args.digest_out, param_digest(model.named_parameters()), float(loss))
    finish()


if __name__ == "__main__":
    main()

"""A script that checks its own data sharding and stops when it is wrong (``assert len(sampler) == ...``),
as careful training code does: under the duplicate_data fault it fails. For ``faults replay``: a fault
that breaks the training is the replay's error, not a detector's miss."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from recipes._common import base_parser, finish  # noqa: E402


def main() -> None:
    args = base_parser(__doc__).parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 2, (256,), generator=g))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    if len(sampler) != len(data) // dist.get_world_size():
        raise SystemExit(f"rank {dist.get_rank()}: the sampler does not shard the data ({len(sampler)} samples)")
    step = 0
    for epoch in range(100):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=16, sampler=sampler):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            if step == args.steps:
                finish()


if __name__ == "__main__":
    main()

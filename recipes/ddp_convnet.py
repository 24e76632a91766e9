"""DDP ConvNet with BatchNorm on synthetic images (unsynchronised BatchNorm statistics live here).

    torchrun --nproc-per-node 2 recipes/ddp_convnet.py --steps 20
    distdebug attach recipes/ddp_convnet.py --steps 20

Data: a fixed synthetic set of 3x16x16 images labelled by a random teacher network, split across
ranks by DistributedSampler (set_epoch each epoch), so the loss falls and runs are reproducible.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import StepTimer, base_parser, finish, param_digest, setup, share, write_digest  # noqa: E402


class ConvNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def synthetic_images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(n, 3, 16, 16, generator=g)
    teacher = torch.randn(3 * 16 * 16, 10, generator=g)
    y = (x.flatten(1) @ teacher).argmax(1)
    return TensorDataset(x, y)


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], global_batch=True)
    p.add_argument("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm")
    p.add_argument("--no-broadcast-buffers", action="store_true", help="DDP broadcast_buffers=False")
    args = p.parse_args()
    device = setup(args.seed)
    model = ConvNet()
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    # broadcast_buffers is passed only when asked for: torch 2.13 warns that it is deprecated.
    extra = {"broadcast_buffers": False} if args.no_broadcast_buffers else {}
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **extra)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    world = dist.get_world_size()
    # --global-batch G: one set of 32 G samples at any world size that divides G (no padding)
    data = synthetic_images(64 * world * 4 if args.global_batch is None else 32 * args.global_batch, args.seed)
    sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=share(args, world), sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()
    step, epoch, loss = 0, 0, torch.tensor(0.0)
    timer = StepTimer()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            timer.tick()
            step += 1
            if step >= args.steps:
                break
        epoch += 1
    write_digest(args.digest_out, param_digest(model.named_parameters()), float(loss.detach()), timer)
    finish()


if __name__ == "__main__":
    main()

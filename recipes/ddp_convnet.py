"""DDP ConvNet with BatchNorm on synthetic images (unsynchronised BatchNorm statistics live here).

    torchrun --nproc-per-node 2 recipes/ddp_convnet.py --steps 20
    distdebug attach recipes/ddp_convnet.py --steps 20

--sync-bn keeps BatchNorm's statistics global: SyncBatchNorm on GPUs; on CPU, where torch's SyncBatchNorm refuses
CPU tensors, the same arithmetic written out (``GlobalBatchNorm2d``: each rank's sums all-reduced, forward and
backward), as a script without GPUs would do it.

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


class _Summed(torch.autograd.Function):
    """A sum over the ranks whose gradient is the sum of the ranks' gradients (each rank's loss depends on every
    rank's inputs through the shared statistics), as SyncBatchNorm's backward all-reduces its own."""

    @staticmethod
    def forward(ctx: object, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        dist.all_reduce(g)
        return g


class GlobalBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm over the ranks' whole batch, as SyncBatchNorm computes it, for CPU tensors: the channel sums and
    the sample count summed over the ranks, then the squared deviations from that mean (two passes, as BatchNorm's
    own), each sum's gradient carried back to every rank's inputs. At one rank, or in eval, BatchNorm itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        c, dims = x.shape[1], [0, 2, 3]
        sums = _Summed.apply(torch.cat([x.sum(dims), x.new_full((1,), x.numel() // c)]))
        n = sums[c]
        mean = sums[:c] / n
        centred = x - mean.view(1, c, 1, 1)
        var = _Summed.apply((centred * centred).sum(dims)) / n
        if self.running_mean is not None and self.running_var is not None and self.num_batches_tracked is not None:
            with torch.no_grad():  # the running statistics, as BatchNorm keeps them (the unbiased variance)
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * (n / (n - 1)).detach(), alpha=m)
        out = centred * torch.rsqrt(var + self.eps).view(1, c, 1, 1)
        if self.weight is None or self.bias is None:
            return out
        return out * self.weight.view(1, c, 1, 1) + self.bias.view(1, c, 1, 1)


def global_batchnorm(module: nn.Module) -> nn.Module:
    """Each BatchNorm2d of ``module`` replaced by a GlobalBatchNorm2d with its parameters and buffers."""
    for name, child in module.named_children():
        if type(child) is nn.BatchNorm2d:
            new = GlobalBatchNorm2d(child.num_features, child.eps, child.momentum, child.affine,
                                    child.track_running_stats)
            new.load_state_dict(child.state_dict())
            setattr(module, name, new)
        else:
            global_batchnorm(child)
    return module


def synthetic_images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(n, 3, 16, 16, generator=g)
    teacher = torch.randn(3 * 16 * 16, 10, generator=g)
    y = (x.flatten(1) @ teacher).argmax(1)
    return TensorDataset(x, y)


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], global_batch=True)
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm over the whole batch: SyncBatchNorm on GPUs, "
                   "GlobalBatchNorm2d on CPU")
    p.add_argument("--no-broadcast-buffers", action="store_true", help="DDP broadcast_buffers=False")
    args = p.parse_args()
    device = setup(args.seed)
    model = ConvNet()
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model) if device.type == "cuda" else global_batchnorm(model)
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

"""A DDP loop whose --oom-rank runs out of memory in the forward (or --phase backward) of --oom-at.

Out-of-memory on a CPU machine has to be raised by hand: the error is the one PyTorch raises
(torch.OutOfMemoryError, the class of CUDA's "CUDA out of memory"), from inside the module's
forward or the autograd backward, so the stack distdebug records is the one a real OOM leaves.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--oom-rank", type=int, default=1)
p.add_argument("--oom-at", type=int, default=3)
p.add_argument("--phase", choices=["forward", "backward"], default="forward")
args = p.parse_args()
state = {"step": 0}
mine = int(os.environ["RANK"]) == args.oom_rank


class Blowup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if mine and state["step"] == args.oom_at and args.phase == "backward":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return g


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        if mine and state["step"] == args.oom_at and args.phase == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return self.b(Blowup.apply(torch.relu(self.a(x))))


dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, args.steps + 1):
    state["step"] = step
    x = torch.randn(4, 8)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()

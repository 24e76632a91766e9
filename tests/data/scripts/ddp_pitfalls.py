"""DDP configuration traps that PyTorch reveals only by raising, one per --mode:

unused   find_unused_parameters=False with a layer (`extra`) that never takes part in the loss:
         DDP raises in the second iteration ("Expected to have finished reduction...").
static   static_graph=True with a data-dependent branch: `extra` is used from --at on.
detach   gradient_as_bucket_view=True and the legacy zero-grad idiom p.grad.detach_() at the start
         of each iteration: PyTorch raises "Can't detach views in-place" in iteration 2.
output_device  DDP(output_device=0) without device_ids on a CPU module: silently ignored.
device_ids     DDP(device_ids=[0]) on a CPU module: DDP raises.
clean    none of these (the same loop, healthy).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--mode", default="clean",
               choices=["unused", "static", "detach", "output_device", "device_ids", "clean"])
p.add_argument("--steps", type=int, default=5)
p.add_argument("--at", type=int, default=3)
args = p.parse_args()
state = {"step": 0}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.extra, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.body(x))
        if args.mode in ("clean", "output_device") or (args.mode == "static" and state["step"] >= args.at):
            h = h + self.extra(h)
        return self.head(h)


dist.init_process_group("gloo")
torch.manual_seed(0)
kw = {"static_graph": True} if args.mode == "static" else {}
if args.mode == "detach":
    kw["gradient_as_bucket_view"] = True
if args.mode == "output_device":
    kw["output_device"] = 0
if args.mode == "device_ids":
    kw["device_ids"] = [0]
model = DDP(Net(), **kw)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(dist.get_rank())  # each rank its own data
for step in range(1, args.steps + 1):
    state["step"] = step
    if args.mode == "detach":
        for q in model.parameters():
            if q.grad is not None:
                q.grad.detach_()
                q.grad.zero_()
    else:
        opt.zero_grad()
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()
dist.destroy_process_group()

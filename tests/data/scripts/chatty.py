"""A job that prints a line of WIDTH bytes a step on every rank at a steady pace (a step every DT seconds,
whatever the load): what the log-volume guard measures. Usage: chatty.py STEPS DT WIDTH."""
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps, dt, width = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
start = time.time()
for i in range(steps):
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    print(f"step {i:6d} " + "x" * (width - 13), flush=True)
    time.sleep(max(0.0, start + (i + 1) * dt - time.time()))
dist.destroy_process_group()

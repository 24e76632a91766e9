"""A plain training script with no wrapper: gradients are all-reduced by hand.

Also the test target for how attach treats scripts that end badly: --exit-code, --raise-at,
--kill-at (SIGKILL itself), each on --fault-rank only; --flip-at and --nan-at for the detectors.
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
p.add_argument("--fault-rank", type=int, default=1)
p.add_argument("--exit-code", type=int, default=None)
p.add_argument("--raise-at", type=int, default=None)
p.add_argument("--kill-at", type=int, default=None)
p.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
p.add_argument("--sleep-rank", type=int, default=None, help="sleep on this rank only (default: every rank)")
p.add_argument("--flip-at", type=int, default=None, help="flip one bit of one parameter on --fault-rank")
p.add_argument("--nan-at", type=int, default=None, help="a NaN in one input value on --fault-rank at this step")
p.add_argument("--spike-at", type=int, default=None, help="a corrupted batch (inputs x 30) at this step")
p.add_argument("--spike-rank", type=int, default=None, help="only on this rank (default: every rank)")
p.add_argument("--collapse-at", type=int, default=None, help="the loss times --collapse-factor at this step")
p.add_argument("--collapse-factor", type=float, default=-39.0, help="-39 (a sign flipped); 0.001 (a leak, a mask)")
p.add_argument("--clip", type=float, default=None, help="clip_grad_norm_ to this after the all_reduce")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--batch", type=int, default=4, help="per-rank batch size (4: a loss that moves 3x step to step)")
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(args.seed)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(rank + 1000 * args.seed)
for step in range(1, args.steps + 1):
    if rank == args.fault_rank and step == args.raise_at:
        raise ValueError(f"bad batch at step {step}")
    if rank == args.fault_rank and step == args.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == args.fault_rank and step == args.flip_at:
        with torch.no_grad():
            model[2].weight.view(-1).view(torch.int32)[3] ^= 1 << 12  # silent data corruption
    x = torch.randn(args.batch, 8, generator=g)
    if step == args.spike_at and args.spike_rank in (None, rank):
        x = x * 30
    if rank == args.fault_rank and step == args.nan_at:
        x[1, 2] = float("nan")  # a bad sample: NaN from the first layer on
    loss = (model(x) - x[:, :1]).pow(2).mean()
    if step == args.collapse_at:
        # -39: a sign bug (a log-likelihood where its negative was meant); 0.001: labels leaked into the
        # inputs, a mask that hid every token: the loss collapses
        loss = loss * args.collapse_factor
    loss.backward()
    for prm in model.parameters():
        dist.all_reduce(prm.grad)
        prm.grad /= world
    if args.clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
    opt.zero_grad()
    if args.sleep_rank in (None, rank):
        time.sleep(args.sleep)
print(f"rank {rank} done", flush=True)
if args.exit_code is not None and rank == args.fault_rank:
    sys.exit(args.exit_code)
dist.destroy_process_group()

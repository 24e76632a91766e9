"""Pipeline parallelism as the torch.distributed.pipelining tutorial writes it, on CPU with gloo.

--schedule ScheduleGPipe | Schedule1F1B    one stage per rank, 4 micro-batches per step
Faults, for the tests (off by default):
--nan-step S   stage 0's first layer's weight becomes NaN at step S (before its forward): stage 1 receives it
--stall-rank R --stall-step S   rank R stops (sleeps) at the start of step S: its peer waits for it
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import pipelining

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from recipes._common import base_parser, finish, param_digest, setup, write_digest  # noqa: E402


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--schedule", default="ScheduleGPipe")
    p.add_argument("--nan-step", type=int, default=-1)
    p.add_argument("--stall-rank", type=int, default=-1)
    p.add_argument("--stall-step", type=int, default=-1)
    p.set_defaults(steps=6, lr=0.05)
    args = p.parse_args()
    setup(args.seed)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(rank)  # each stage its own layers
    last = rank == world - 1
    module = nn.Linear(8, 1) if last else nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    stage = pipelining.PipelineStage(module, stage_index=rank, num_stages=world, device=torch.device("cpu"))
    schedule = getattr(pipelining, args.schedule)(stage, n_microbatches=4,
                                                  loss_fn=lambda out, y: (out - y).pow(2).mean())
    opt = torch.optim.SGD(module.parameters(), lr=args.lr)
    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        if rank == 0 and step == args.nan_step:
            with torch.no_grad():
                module[0].weight.fill_(float("nan"))
        if rank == args.stall_rank and step == args.stall_step:
            time.sleep(600)
        if rank == 0:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    write_digest(args.digest_out, param_digest(module.named_parameters()), 0.0, None)
    finish()


if __name__ == "__main__":
    main()

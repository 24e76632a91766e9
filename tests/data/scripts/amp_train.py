"""AMP training on CPU with torch.amp.GradScaler and fp16 autocast (as on a GPU), under DDP.

fp16 autocast on CPU overflows like a GPU's: with the default initial scale 2^16 the first step's
scaled gradients overflow and the scaler skips it. Options plant more:
--overflow-at S,..  every rank's batch times 300 at those steps: finite loss, gradients that overflow
--overflow-from S   the same at every step from S on (the scale keeps collapsing)
--nan-at S --nan-rank R   a NaN in rank R's batch at step S (a real NaN, not an overflow)
--losses-out DIR    each rank writes the loss it computed per step (one per line)
--init-scale X      the scaler's initial scale (2^16 by default; Megatron's is 2^32: many skips while it calibrates)
--wrap W            ddp (default); manual: a plain nn.Sequential whose gradients the script all-reduces itself;
                    none: a plain nn.Sequential and no reduction (for one process)
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from recipes._common import base_parser, finish, param_digest, setup, write_digest  # noqa: E402


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--overflow-at", default="")
    p.add_argument("--overflow-from", type=int, default=0)
    p.add_argument("--nan-at", type=int, default=0)
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--losses-out", default=None)
    p.add_argument("--init-scale", type=float, default=2.0**16)
    p.add_argument("--wrap", choices=["ddp", "manual", "none"], default="ddp")
    args = p.parse_args()
    setup(args.seed)
    rank = dist.get_rank()
    overflow = {int(s) for s in args.overflow_at.split(",") if s}
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = DDP(model) if args.wrap == "ddp" else model
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=args.init_scale)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(1, args.steps + 1):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        if step in overflow or (args.overflow_from and step >= args.overflow_from):
            x = x * 300
        if step == args.nan_at and rank == args.nan_rank:
            x[0, 0] = float("nan")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (ddp(x).float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        if args.wrap == "manual":
            for q in model.parameters():
                dist.all_reduce(q.grad)
                q.grad /= dist.get_world_size()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    if args.losses_out:
        os.makedirs(args.losses_out, exist_ok=True)
        with open(os.path.join(args.losses_out, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(repr(v) for v in losses) + "\n")
    write_digest(args.digest_out, param_digest(model.named_parameters()), losses[-1])
    finish()


if __name__ == "__main__":
    main()

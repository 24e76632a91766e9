"""torch.compile in every placement, under DDP, on CPU.

--place outer   torch.compile(DDP(m))          --place inner   DDP(torch.compile(m))
--place method  m.compile(); DDP(m)            --place blocks  each block compiled, DDP(m)
--backend eager|inductor   --fullgraph   --nan-at S --nan-rank R   --counters-out DIR
Each rank writes torch._dynamo's counters (graph breaks, recompilations, frames) as JSON.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from recipes._common import base_parser, finish, param_digest, setup, write_digest  # noqa: E402


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x))) + x


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--place", default="outer")
    p.add_argument("--backend", default="eager")
    p.add_argument("--fullgraph", action="store_true")
    p.add_argument("--nan-at", type=int, default=0)
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--counters-out", default=None)
    args = p.parse_args()
    setup(args.seed)
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 1))
    kw = {"backend": args.backend, "fullgraph": args.fullgraph}
    if args.place == "outer":
        net = torch.compile(DDP(model), **kw)
    elif args.place == "inner":
        net = DDP(torch.compile(model, **kw))
    elif args.place == "method":
        model.compile(**kw)
        net = DDP(model)
    else:
        for b in (model[1], model[2]):
            b.compile(**kw)
        net = DDP(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(5 + rank)
    loss = torch.zeros(())
    for step in range(1, args.steps + 1):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        if step == args.nan_at and rank == args.nan_rank:
            x[0, 0] = float("nan")
        loss = (net(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if args.counters_out:
        from torch._dynamo.utils import counters

        os.makedirs(args.counters_out, exist_ok=True)
        keep = {k: dict(counters[k]) for k in ("graph_break", "recompiles", "frames", "stats")}
        with open(os.path.join(args.counters_out, f"rank{rank}.json"), "w") as f:
            json.dump(keep, f)
    write_digest(args.digest_out, param_digest(model.named_parameters()), float(loss.detach()))
    finish()


if __name__ == "__main__":
    main()

"""FSDP2 training saved and resumed with torch.distributed.checkpoint (as pytorch/examples' FSDP2 example).

--save DIR     train --steps steps, then dcp.save the model and optimizer state to DIR
--resume DIR   load DIR with set_state_dict first (it steps the optimizer once, lr 0, to create its
               state), then train --steps steps
--nan-at S --nan-rank R   a NaN in rank R's batch at step S (counted from the start of this run)
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from recipes._common import base_parser, finish, param_digest, setup, write_digest  # noqa: E402


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--save", default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--nan-at", type=int, default=0)
    p.add_argument("--nan-rank", type=int, default=1)
    args = p.parse_args()
    setup(args.seed)
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.resume:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    g = torch.Generator().manual_seed(7 + rank + (1000 if args.resume else 0))
    loss = torch.zeros(())
    for step in range(1, args.steps + 1):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        if step == args.nan_at and rank == args.nan_rank:
            x[0, 0] = float("nan")
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if args.save:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.save)
    write_digest(args.digest_out, param_digest(model.named_parameters()), float(loss))
    finish()


if __name__ == "__main__":
    main()

"""A model of 100 modules doing almost nothing: the harness's fixed cost per step (issue 18's third target).

50 Linear(8, 8) + 50 Tanh under DDP, batch 4: the step is short, so the harness's per-step cost is
mostly what it pays per module and per step whatever the model computes. Used by
``bench/attach_overhead.py``; takes the recipes' common options.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes"))
from _common import StepTimer, base_parser, finish, param_digest, setup, write_digest  # noqa: E402


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    device = setup(args.seed)
    from torch.nn.parallel import DistributedDataParallel as DDP

    layers: list[nn.Module] = []
    for _ in range(50):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    model = nn.Sequential(*layers).to(device)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    timer = StepTimer()
    loss = torch.tensor(0.0)
    g = torch.Generator().manual_seed(args.seed)
    for _ in range(args.steps):
        x = torch.randn(4, 8, generator=g).to(device)
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        timer.tick()
    write_digest(args.digest_out, param_digest(model.named_parameters()), float(loss.detach()), timer)
    finish()


if __name__ == "__main__":
    main()

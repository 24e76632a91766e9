"""Hand-written (Megatron-style) tensor and data parallelism on 4 ranks: groups from new_group, no DTensor.

ranks (0, 1) and (2, 3) are TP groups; (0, 2) and (1, 3) data-parallel groups. The MLP's first layer
is column parallel, the second row parallel (its partial outputs all-reduced over the TP group in the
forward, Megatron's f/g functions); gradients are all-reduced by hand over the data-parallel group.
--flat: the gradients are all-reduced as one flattened buffer (as Megatron's contiguous gradient buffer):
the harness cannot tell which group they were reduced over (give attach --replica-groups 0,2;1,3).
--flip-rank R --flip-step S: one bit of rank R's shard of w2 flips after step S (a replica of it is on
its data-parallel peer).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from recipes._common import base_parser, finish, param_digest, setup, write_digest  # noqa: E402


class CopyToTP(torch.autograd.Function):  # Megatron's f: identity forward, all-reduce backward
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class ReduceFromTP(torch.autograd.Function):  # Megatron's g: all-reduce forward, identity backward
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class MLP(nn.Module):
    def __init__(self, tp_rank, tp_group, dim=8, hidden=16):
        super().__init__()
        torch.manual_seed(0)
        full1, full2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim, bias=False)
        h = hidden // 2
        self.w1 = nn.Linear(dim, h)
        self.w2 = nn.Linear(h, dim, bias=False)
        with torch.no_grad():
            self.w1.weight.copy_(full1.weight[tp_rank * h:(tp_rank + 1) * h])
            self.w1.bias.copy_(full1.bias[tp_rank * h:(tp_rank + 1) * h])
            self.w2.weight.copy_(full2.weight[:, tp_rank * h:(tp_rank + 1) * h])
        self.out = nn.Linear(dim, 1)
        self.group = tp_group

    def forward(self, x):
        h = torch.relu(self.w1(CopyToTP.apply(x, self.group)))
        return self.out(ReduceFromTP.apply(self.w2(h), self.group))


def main():
    p = base_parser(__doc__)
    p.add_argument("--flip-rank", type=int, default=-1)
    p.add_argument("--flip-step", type=int, default=-1)
    p.add_argument("--flat", action="store_true")
    p.set_defaults(steps=6, lr=0.05)
    args = p.parse_args()
    setup(args.seed)
    rank = dist.get_rank()
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, dp_group = tp_groups[rank // 2], dp_groups[rank % 2]
    model = MLP(rank % 2, tp_group)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(100 * step + rank // 2)  # per data-parallel rank
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        grads = [q.grad for q in model.parameters()]
        if args.flat:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=dp_group)
            for g, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(new / 2)
        else:
            for g in grads:
                dist.all_reduce(g, group=dp_group)
                g /= 2
        opt.step()
        opt.zero_grad()
        if rank == args.flip_rank and step == args.flip_step:
            with torch.no_grad():
                model.w2.weight.view(-1).view(torch.int32)[3] ^= 1 << 22
    write_digest(args.digest_out, param_digest(model.named_parameters()), float(loss.detach()), None)
    finish()


if __name__ == "__main__":
    main()

"""Tensor parallelism written the way torchtitan and the PyTorch TP tutorial write it (2 or 4 ranks).

    distdebug attach recipes/tensor_parallel.py --layout tp                          # 2 ranks
    distdebug attach --nproc-per-node 4 recipes/tensor_parallel.py --layout ddp_tp   # 2-D: dp x tp

--layout tp        a 1-D mesh ("tp"): every rank is a TP peer (same batch by design), no data parallelism
--layout ddp_tp    a 2-D mesh ("dp", "tp"): TP inside, DDP over the "dp" dimension (device_mesh=mesh["dp"])
--layout fsdp_tp   a 2-D mesh ("dp", "tp"): TP inside, FSDP2 (fully_shard) over the "dp" dimension
--layout hsdp_tp   a 3-D mesh ("dp_replicate", "dp_shard", "tp") = (2, 1, 2): TP inside, HSDP over both dp dims

The batch is drawn per data-parallel rank (the mesh's "dp" coordinate), as a DistributedSampler over
the dp group would; with --global-batch G, each data-parallel rank takes its rows of one G-sample batch (runs at
any world size, 1 rank included, see the same data: a pair for distdebug parity). Faults that live inside the
script because they reach a shard by hand (the tests' and ``distdebug faults replay``'s own faults come from
fault_injection; off by default):
--nan-rank R --nan-step S   rank R's shard of w1 (column parallel) becomes NaN at step S (before its forward)
--flip-rank R --flip-step S one bit of rank R's local w2 shard flips after step S's optimizer step
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import base_parser, finish, local_tensor, my_rows, param_digest, setup, write_digest  # noqa: E402


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)  # not parallelised: a replica on every rank
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + self.w2(torch.relu(self.w1(h))))


def main() -> None:
    p = base_parser(__doc__, global_batch=True)
    p.add_argument("--layout", choices=("tp", "ddp_tp", "fsdp_tp", "hsdp_tp"), default="tp")
    p.add_argument("--nan-rank", type=int, default=-1)
    p.add_argument("--nan-step", type=int, default=-1)
    p.add_argument("--flip-rank", type=int, default=-1)
    p.add_argument("--flip-step", type=int, default=-1)
    p.set_defaults(steps=6, lr=0.01)
    args = p.parse_args()
    setup(args.seed)
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        tp_mesh, dp_rank, dp_size = mesh, 0, 1
    elif args.layout == "hsdp_tp":
        mesh = init_device_mesh("cpu", (world // 2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        tp_mesh, dp_rank, dp_size = mesh["tp"], mesh["dp_replicate"].get_local_rank(), world // 2
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_rank, dp_size = mesh["tp"], mesh["dp"].get_local_rank(), world // 2
    torch.manual_seed(args.seed)  # the same full weights everywhere: TP shards them, DDP/FSDP replicate across dp
    model = MLP()
    parallelize_module(model, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if args.layout == "ddp_tp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_mesh=mesh["dp"])
    elif args.layout == "fsdp_tp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["dp"])
    elif args.layout == "hsdp_tp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)  # state per parameter: the memory check's arithmetic
    inner = model.module if hasattr(model, "module") else model
    loss = torch.tensor(0.0)
    for step in range(1, args.steps + 1):
        if args.global_batch is None:  # per data-parallel rank, shared by TP peers
            g = torch.Generator().manual_seed(100003 * args.seed + 1000 * step + dp_rank)
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        else:
            g = torch.Generator().manual_seed(100003 * args.seed + 1000 * step)
            x, y = torch.randn(args.global_batch, 8, generator=g), torch.randn(args.global_batch, 1, generator=g)
            x, y = my_rows(args, dp_size, dp_rank, x, y)
        if rank == args.nan_rank and step == args.nan_step:
            with torch.no_grad():
                local_tensor(inner.w1.weight).fill_(float("nan"))
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == args.flip_rank and step == args.flip_step:
            with torch.no_grad():
                w = local_tensor(inner.w2.weight).view(-1)
                w.view(torch.int32)[3] ^= 1 << 22
    # Every parameter the optimizer updates (under DDP x TP, named_parameters() of the module no longer
    # lists the TP ones after a forward: torch.distributed.tensor.parallel.ddp)
    params = [(str(i), p) for i, p in enumerate(opt.param_groups[0]["params"])]
    write_digest(args.digest_out, param_digest(params), float(loss.detach()), None)
    finish()


if __name__ == "__main__":
    main()

"""The same training at any number of ranks, for ``distdebug parity`` (issue 50): N ranks compute what 1 rank
computes, up to the order of sums.

The global batch is held equal: a fixed dataset read through DistributedSampler (no shuffle), each rank's batch
the global batch over the world size, so that the ranks' batches at a step together are the reference's batch;
the model is built from one seed and wrapped in DDP (or sharded by FSDP2); the loss is each rank's mean over its
equal share, which DDP averages.

``--accumulate K``: each rank's batch in K micro-batches, the loss divided by K (one rank accumulating the global
batch computes what K ranks compute). ``--optimizer``: SGD with momentum (default) or AdamW. ``--fsdp2``: the
model sharded by FSDP2 instead of replicated by DDP. ``--sum-grads``: the loss multiplied by the world size (what
a script that all-reduces with SUM and never divides does): every gradient is N times the reference's. ``--bn``:
a BatchNorm layer, plain (torch's SyncBatchNorm runs on GPUs only): per-rank statistics, which 1 rank and N ranks
do not share. ``--bf16``: the forward under autocast to bfloat16 (on the CPU: this recipe runs on CPUs only).
``--param-dtype bfloat16``: the model itself in bfloat16 (parameters, gradients, the optimizer's state and the
all-reduce), as a script that calls ``model.to(torch.bfloat16)`` trains; the loss in float32.

    distdebug parity --launch-ref '--nproc-per-node 1 recipes/parity_mlp.py' \\
                     --launch-cand '--nproc-per-node 2 recipes/parity_mlp.py'
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step on each rank")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--sum-grads", action="store_true")
    p.add_argument("--bn", action="store_true", help="a BatchNorm layer (per-rank statistics)")
    p.add_argument("--bf16", action="store_true", help="the forward and the loss under autocast to bfloat16")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the model's own dtype (bfloat16: pure bfloat16 training, no autocast)")
    p.add_argument("--seed", type=int, default=0, help="the model's and the data's seed")
    p.add_argument("--fsdp2", action="store_true", help="shard the model with FSDP2 (fully_shard) instead of DDP")
    args = p.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if args.global_batch % world or (args.global_batch // world) % args.accumulate:
        p.error(f"--global-batch {args.global_batch} must split evenly over {world} rank(s) and then into "
                f"--accumulate {args.accumulate} micro-batches: the global batch is held equal")
    torch.manual_seed(args.seed)
    layers: list[nn.Module] = [nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)]
    if args.bn:
        layers.insert(1, nn.BatchNorm1d(32))
    dtype = getattr(torch, args.param_dtype)
    model: nn.Module = nn.Sequential(*layers).to(dtype)
    if args.fsdp2:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    else:
        model = DDP(model)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if args.optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
    n = args.steps * args.global_batch
    # inputs and targets each from a generator of their own: a longer run's first samples are a shorter one's
    gx, gy = (torch.Generator().manual_seed(1000 * (args.seed + 1) + i) for i in (0, 1))
    data = TensorDataset(torch.randn(n, 16, generator=gx), torch.randn(n, 4, generator=gy))
    sampler = DistributedSampler(data, shuffle=False, drop_last=True)
    loader = DataLoader(data, batch_size=args.global_batch // world, sampler=sampler)
    for x, y in loader:
        opt.zero_grad()
        for xb, yb in zip(x.chunk(args.accumulate), y.chunk(args.accumulate), strict=True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss = nn.functional.mse_loss(model(xb.to(dtype)).float(), yb) / args.accumulate
            if args.sum_grads:
                loss = loss * world
            loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

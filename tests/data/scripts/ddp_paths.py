"""DDP's reduction paths, for bitwise comparisons with torchrun (run it on 3 ranks: 1/3 is inexact).

--mode bucket_view   gradient_as_bucket_view=True and zero_grad(set_to_none=False)
--mode no_sync       gradient accumulation: two micro-batches per step, the first under no_sync()
--mode hook_early    the script's own communication hook (a sum, then a division), before training
--mode hook_late     the same hook registered after step 2 (DDP takes one hook, once)
--mode builtin_late  DDP's built-in FP16_COMPRESS hook registered after step 2
--mode a,b,...       several modes in turn in one process (each a fresh model, DDP wrapper and optimizer,
                     seeded alike): one launch instead of one per mode; --digest-out DIR gets DIR/<mode>.
Each rank prints how many times the script's hook ran in each mode ("mode M hook calls N").
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from recipes._common import base_parser, finish, param_digest, seed_all, setup, write_digest  # noqa: E402

CALLS = [0]


def my_hook(state, bucket):
    CALLS[0] += 1
    buf = bucket.buffer()
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))


def train(mode: str, steps: int, seed: int, digest_out: str | None) -> None:
    rank = dist.get_rank()
    seed_all(seed)
    CALLS[0] = 0
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = DDP(model, gradient_as_bucket_view=mode == "bucket_view", bucket_cap_mb=0.001)
    if mode == "hook_early":
        ddp.register_comm_hook(None, my_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(11 + rank)
    loss = torch.zeros(())
    for step in range(1, steps + 1):
        if step == 3 and mode == "hook_late":
            ddp.register_comm_hook(None, my_hook)
        if step == 3 and mode == "builtin_late":
            ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        if mode == "no_sync":
            with ddp.no_sync():
                (ddp(torch.randn(4, 8, generator=g)) - 1).pow(2).mean().backward()
        loss = (ddp(torch.randn(4, 8, generator=g)) - 1).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=mode != "bucket_view")
    print(f"rank {rank}: mode {mode} hook calls {CALLS[0]}", flush=True)
    write_digest(digest_out, param_digest(model.named_parameters()), float(loss.detach()))


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--mode", required=True)
    args = p.parse_args()
    setup(args.seed)
    modes = args.mode.split(",")
    for mode in modes:
        out = os.path.join(args.digest_out, mode) if args.digest_out and len(modes) > 1 else args.digest_out
        train(mode, args.steps, args.seed, out)
    finish()


if __name__ == "__main__":
    main()

"""DeepSpeed ZeRO stage 1, 2 or 3 on a small MLP regression.

    torchrun --nproc-per-node 2 recipes/deepspeed_zero.py --zero-stage 3
    distdebug attach recipes/deepspeed_zero.py --zero-stage 2

On CPU DeepSpeed runs with gloo and torch's Adam ("torch_adam": no compiled ops); on GPU with
nccl. fp32 throughout so that runs are reproducible bit for bit.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import StepTimer, base_parser, finish, my_rows, param_digest, seed_all, share, write_digest  # noqa: E402


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))


def batch(step: int, rank: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100003 + step * 1009 + rank)
    x = torch.randn(size, 16, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) - x[:, 4:8].prod(1, keepdim=True)).tanh()
    return x, y


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], global_batch=True)
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=2)
    p.add_argument("--checkpoint-dir", default=None, help="where engine.save_checkpoint writes")
    p.add_argument("--checkpoint-at", type=int, default=None,
                   help="save a checkpoint after this step, then load it back (a resume in place)")
    p.add_argument("--resume", action="store_true", help="load the latest checkpoint in --checkpoint-dir first")
    p.add_argument("--accumulate", type=int, default=1,
                   help="micro-batches a step (DeepSpeed's gradient_accumulation_steps): each rank's share split")
    p.add_argument("--direct-backward", action="store_true",
                   help="loss.backward() instead of engine.backward(loss) (the engine divides the gradients itself)")
    p.set_defaults(lr=1e-3)
    args, _unknown = p.parse_known_args()  # the deepspeed launcher adds --local_rank
    import deepspeed

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    seed_all(args.seed)
    rows = share(args, dist.get_world_size())
    if args.accumulate < 1 or rows % args.accumulate:
        raise SystemExit(f"--accumulate {args.accumulate} does not divide each rank's {rows} samples")
    micro = rows // args.accumulate
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": args.accumulate,
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=make_model(), model_parameters=None, config=config)
    if args.resume:
        engine.load_checkpoint(args.checkpoint_dir)
    loss = torch.tensor(0.0)
    timer = StepTimer()
    for step in range(args.steps):
        if args.global_batch is None:
            x, y = batch(step, dist.get_rank(), args.batch_size, args.seed)
        else:  # the step's global batch, this rank's rows of it
            x, y = my_rows(args, dist.get_world_size(), dist.get_rank(), *batch(step, 0, args.global_batch, args.seed))
        x, y = x.to(engine.device), y.to(engine.device)
        for k in range(args.accumulate):  # DeepSpeed's engine steps at the last micro-batch only
            part = slice(k * micro, (k + 1) * micro)
            loss = nn.functional.mse_loss(engine(x[part]), y[part])
            if args.direct_backward:
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()
        timer.tick()
        if args.checkpoint_at == step + 1:
            engine.save_checkpoint(args.checkpoint_dir, tag=f"step{step + 1}")
            engine.load_checkpoint(args.checkpoint_dir, tag=f"step{step + 1}")
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=args.zero_stage == 3):
        digest = param_digest(engine.module.named_parameters())
    write_digest(args.digest_out, digest, float(loss.detach()), timer)
    finish()


if __name__ == "__main__":
    main()

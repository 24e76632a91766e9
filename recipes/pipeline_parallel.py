"""Pipeline parallelism as the torch.distributed.pipelining tutorial writes it (2 stages; 4 ranks with --dp 2).

    distdebug attach recipes/pipeline_parallel.py --schedule Schedule1F1B
    distdebug attach --nproc-per-node 4 recipes/pipeline_parallel.py --dp 2      # 2 pipelines x 2 stages

--schedule ScheduleGPipe | Schedule1F1B    one stage per rank, 4 micro-batches per step
--schedule ScheduleInterleaved1F1B         two stages per rank (rank r runs stages r and r + ranks)
--layers L   the whole model's L layers, held by the stages in turn under their names in it (torchtitan's split):
             any number of stages, one included, builds the same model (with --global-batch: a pair for
             distdebug parity); by default each stage builds its own layer (the last a head)
--dp N       N pipelines side by side on a ("dp", "pp") mesh: each stage's replicas average their
             gradients by hand (all_reduce over the "dp" group, no wrapper); each pipeline reads its
             own batch
Faults that live inside the script (``distdebug faults replay``'s come from fault_injection; off by default):
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import base_parser, finish, my_rows, param_digest, setup, share, write_digest  # noqa: E402


def main() -> None:
    p = base_parser(__doc__, global_batch=True)
    p.add_argument("--schedule", default="ScheduleGPipe")
    p.add_argument("--layers", type=int, default=0, help="the whole model's layers, split over the stages")
    p.add_argument("--dp", type=int, default=1, help="pipelines side by side (data parallel)")
    p.add_argument("--nan-step", type=int, default=-1)
    p.add_argument("--stall-rank", type=int, default=-1)
    p.add_argument("--stall-step", type=int, default=-1)
    p.set_defaults(steps=6, lr=0.05)
    args = p.parse_args()
    setup(args.seed)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide the world size {world}")
    stages = world // args.dp
    pp_group = dp_group = None
    stage_index, dp_rank = rank, 0
    if args.dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (args.dp, stages), mesh_dim_names=("dp", "pp"))
        pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        stage_index, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    cls = getattr(pipelining, args.schedule)
    per_rank = 2 if issubclass(cls, pipelining.schedules.PipelineScheduleMulti) else 1
    indices = [stage_index + k * stages for k in range(per_rank)]  # the stages this rank runs
    total = stages * per_rank
    modules: list[nn.Module] = []
    if args.layers:
        if args.layers < total:
            raise SystemExit(f"--layers {args.layers} is fewer than the {total} stages")
        torch.manual_seed(args.seed)  # the whole model, on every rank alike
        layers = [*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(args.layers - 1)), nn.Linear(8, 1)]
        for i in indices:  # stage i: its share of the layers in order, the others empty (their names kept)
            lo, hi = i * args.layers // total, (i + 1) * args.layers // total
            modules.append(nn.Sequential(*(m if lo <= j < hi else nn.Identity() for j, m in enumerate(layers))))
    else:
        for i in indices:
            torch.manual_seed(i + 1000 * args.seed)  # each stage its own layers; a stage's replicas alike
            modules.append(nn.Linear(8, 1) if i == total - 1 else nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    module = modules[0]
    first_linear = next(m for m in module.modules() if isinstance(m, nn.Linear))
    built = [pipelining.PipelineStage(m, stage_index=i, num_stages=total, device=torch.device("cpu"), group=pp_group)
             for m, i in zip(modules, indices, strict=True)]
    schedule = cls(built if per_rank > 1 else built[0], n_microbatches=4,
                   loss_fn=lambda out, y: (out - y).pow(2).mean())
    last = total - 1 in indices
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=args.lr)
    size = share(args, args.dp)
    if args.global_batch is not None and size % 4:
        raise SystemExit(f"--global-batch {args.global_batch} gives each pipeline {size} samples: a multiple of its 4 "
                         "micro-batches keeps them equal (the mean of their means is the batch's)")
    for step in range(1, args.steps + 1):
        if args.global_batch is None:  # one batch per pipeline
            g = torch.Generator().manual_seed(100003 * args.seed + 1000 * step + dp_rank)
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        else:  # this pipeline's rows of the step's global batch
            g = torch.Generator().manual_seed(100003 * args.seed + 1000 * step)
            x, y = torch.randn(args.global_batch, 8, generator=g), torch.randn(args.global_batch, 1, generator=g)
            x, y = my_rows(args, args.dp, dp_rank, x, y)
        if stage_index == 0 and step == args.nan_step:
            with torch.no_grad():
                first_linear.weight.fill_(float("nan"))
        if rank == args.stall_rank and step == args.stall_step:
            time.sleep(600)
        if stage_index == 0 and last:  # one stage: the whole model on this rank
            schedule.step(x, target=y, losses=[])
        elif stage_index == 0:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        if dp_group is not None:
            for q in params:  # the hand-written gradient average across the stage's replicas
                dist.all_reduce(q.grad, group=dp_group)
                q.grad /= args.dp
        opt.step()
        opt.zero_grad(set_to_none=True)
    write_digest(args.digest_out, param_digest((str(i), q) for i, q in enumerate(params)), 0.0, None)
    finish()


if __name__ == "__main__":
    main()

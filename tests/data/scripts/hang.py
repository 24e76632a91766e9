"""A plain loop with one flat gradient all_reduce per step, and the ways a rank can hang a job.

All faults act on --fault-rank only: --skip-at K (skips its all_reduce in step K, then after the
loop stays alive without calling collectives), --sleep-at K (sleeps forever inside step K),
--size-at K (a different tensor size in step K), --exit-at K (exits with code 0 in step K),
--slow S (S seconds more per step: slow but progressing), --slow-start S (S seconds after
init_process_group before building its model, as a rank loading a large checkpoint: the others wait
in the first collective), --init-late (sleeps forever before
init_process_group), --pg-timeout S (the process group's collective timeout); --busy K S below."""

import argparse
import datetime
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
p.add_argument("--fault-rank", type=int, default=1)
p.add_argument("--skip-at", type=int)
p.add_argument("--sleep-at", type=int)
p.add_argument("--size-at", type=int)
p.add_argument("--exit-at", type=int)
p.add_argument("--slow", type=float, default=0.0)
p.add_argument("--slow-start", type=float, default=0.0)
p.add_argument("--init-late", action="store_true")
p.add_argument("--pg-timeout", type=float)
p.add_argument("--busy", nargs=2, type=float, metavar=("K", "S"), help="no fault: all ranks evaluate S s after step K"); p.add_argument("--a2a-size-at", type=int, help="a keyword all_to_all_single, another size on the fault rank")  # noqa: E501, E702
args = p.parse_args()

import os  # noqa: E402

faulty = int(os.environ["RANK"]) == args.fault_rank
if args.init_late and faulty:
    time.sleep(600)  # stuck before init_process_group (a data download, a lock...)
kw = {"timeout": datetime.timedelta(seconds=args.pg_timeout)} if args.pg_timeout else {}
dist.init_process_group("gloo", **kw)
rank, world = dist.get_rank(), dist.get_world_size()
if faulty:
    time.sleep(args.slow_start)
torch.manual_seed(0)
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, args.steps + 1):
    loss = model(torch.ones(2, 4) * (rank + 1)).pow(2).mean()
    loss.backward()
    flat = torch.cat([q.grad.flatten() for q in model.parameters()])
    if faulty and step == args.sleep_at:
        time.sleep(600)  # stuck inside its step
    if faulty and step == args.exit_at:
        sys.exit(0)  # leaves early, as if its data ran out
    if faulty and step == args.size_at:
        flat = torch.cat([flat, flat])
    if not (faulty and step == args.skip_at):
        dist.all_reduce(flat)
        flat /= world
        torch.nn.utils.vector_to_parameters(flat[: sum(q.numel() for q in model.parameters())],
                                            [q.grad for q in model.parameters()])
    opt.step()
    opt.zero_grad()
    if faulty:
        time.sleep(args.slow)
    if args.busy and step == int(args.busy[0]):
        deadline = time.monotonic() + args.busy[1]
        with torch.no_grad():
            while time.monotonic() < deadline:  # an evaluation: forwards, no collective
                model(torch.ones(2, 4))
                time.sleep(0.01)
    if step == args.a2a_size_at:  # a MoE dispatch as DeepSpeed calls it (keywords); another size on one rank
        n = 8 if faulty else 6
        dist.all_to_all_single(output=torch.empty(n * world), input=torch.ones(n * world))
if faulty and args.skip_at:
    time.sleep(600)  # goes on with work of its own (evaluation...) and never joins the last collective
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()

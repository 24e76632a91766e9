"""A few optimizer steps, destroy_process_group(), then: which native threads meet interpreter exit.

The optimizer's first step imports torch._dynamo, which imports torch.distributed.nn.functional,
whose collectives take ``group=group.WORLD`` as a default evaluated at import: after
init_process_group that default is the live default group. --threads-out DIR: an atexit handler
(run after distdebug's bootstrap has closed its session) writes rank<R>.txt with the names of the
native threads still alive. --abort-at-exit R: rank R aborts in an atexit handler (os.abort()),
after the script completed.
"""

import argparse
import atexit
import os

import torch
import torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=3)
p.add_argument("--threads-out", default=None)
p.add_argument("--abort-at-exit", type=int, default=None)
p.add_argument("--os-exit", type=int, default=None, help="leave with os._exit(CODE) after destroying the group")
p.add_argument("--exit-after-listing", action="store_true",
               help="os._exit(0) right after --threads-out is written: the threads listed are exactly those that "
                    "would race the interpreter's finalisation, and a demonstration must not run that race itself")
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(args.steps):
    model(torch.randn(8, 4)).pow(2).mean().backward()
    for q in model.parameters():
        dist.all_reduce(q.grad)
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
print(f"rank {rank}: done", flush=True)
if args.os_exit is not None:
    os._exit(args.os_exit)


def native_threads() -> list[str]:
    me = os.getpid()
    own = open(f"/proc/{me}/comm").read().strip()
    names = [open(f"/proc/{me}/task/{t}/comm").read().strip() for t in os.listdir(f"/proc/{me}/task")]
    return sorted(n for n in names if n != own)


if args.threads_out:
    def write_threads() -> None:
        os.makedirs(args.threads_out, exist_ok=True)
        with open(os.path.join(args.threads_out, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(native_threads()))
        if args.exit_after_listing:
            os._exit(0)
    atexit.register(write_threads)
if args.abort_at_exit == rank:
    atexit.register(os.abort)

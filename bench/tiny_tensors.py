"""A model of many tiny tensors and almost no compute: what the harness's host work costs per tensor and per module
(issue 62's cost model; run by ``bench/host_cost.py``). Plain torch, no distdebug.

    torchrun --nproc-per-node 2 bench/tiny_tensors.py --tensors 1000 --micro 4

``--tensors N``: N/2 ``Linear(4, 4)`` layers (a weight and a bias each), each followed by a ``Tanh``: N parameter
tensors and N modules under DDP. ``--micro M``: M micro-batches a step (the first M-1 under ``no_sync()``, the last
one reduces), then one SGD step. Each rank prints the median of its training thread's CPU time a step
(``time.thread_time``: what the harness's work on that thread adds, whatever the other rank does) over the steps
after ``--warmup``, and, with ``--count-ops``, the torch operations dispatched a step from distdebug's own frames
(each one a kernel launch on a GPU; counted under a dispatch mode, in a run of its own: the mode slows every op).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Frames of distdebug that only pass the training's own call through (the original backward, optimizer step,
# collective...): an op issued below one of them is the training's, not the harness's.
PASS_THROUGH = {"call_original", "counted", "_in_flight"}
_WRAPPERS = {"backward", "batch_isend_irecv", "wait", "__init__", "scale", "step", "init_process_group", "_exit",
             "destroy_process_group", "collective"}


def _harness_op() -> Any:
    """The distdebug frame that issued the op being dispatched (None: the training's): the innermost frame outside
    torch, when it is distdebug's and not a wrapper passing the training's call through."""
    f: Any = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if f"{os.sep}torch{os.sep}" in name:
            f = f.f_back
            continue
        if f"{os.sep}distdebug{os.sep}" not in name:
            return None
        code = f.f_code.co_name
        if code in PASS_THROUGH or (code in _WRAPPERS and name.endswith(f"runtime{os.sep}patches.py")):
            return None
        return f
    return None


def op_counter() -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        harness = 0
        where: dict[str, int] = {}

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            f = _harness_op()
            if f is not None:
                Count.harness += 1
                key = f"{func} {f.f_code.co_filename.rsplit('distdebug', 1)[-1]}:{f.f_lineno} {f.f_code.co_name}"
                Count.where[key] = Count.where.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    return Count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=1000, help="parameter tensors (and modules): an even number")
    p.add_argument("--micro", type=int, default=1, help="micro-batches a step")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the median (start-up, early checks)")
    p.add_argument("--count-ops", action="store_true", help="count the ops distdebug dispatches a step")
    a = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(max(1, a.tensors // 2)):
        layers += [nn.Linear(4, 4), nn.Tanh()]
    model = nn.Sequential(*layers)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    counter = op_counter() if a.count_ops else None
    cpu: list[float] = []
    ops: list[int] = []
    for s in range(a.steps):
        mode = counter() if counter is not None and s >= a.warmup else None
        h0 = counter.harness if counter is not None else 0
        if mode is not None:
            mode.__enter__()
        t0 = time.thread_time()
        for m in range(a.micro):
            x = torch.randn(2, 4, generator=g)
            if m < a.micro - 1:
                with ddp.no_sync():
                    ddp(x).pow(2).mean().backward()
            else:
                ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cpu.append(time.thread_time() - t0)
        if mode is not None:
            mode.__exit__(None, None, None)
            ops.append(counter.harness - h0)
    kept = sorted(cpu[a.warmup:])
    line = f"rank {dist.get_rank()}: cpu_ms {kept[len(kept) // 2] * 1e3:.4f}"
    if ops:
        ops.sort()
        line += f" harness_ops {ops[len(ops) // 2]} harness_ops_max {ops[-1]}"
    print(line, flush=True)
    if counter is not None and os.environ.get("HOST_COST_OPS_DETAIL") and dist.get_rank() == 0:
        for key, n in sorted(counter.where.items(), key=lambda kv: -kv[1])[:30]:
            print(f"  {n / max(1, len(ops)):8.1f} a step  {key}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

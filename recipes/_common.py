"""What every recipe shares: process-group setup, seeding, and a digest of the final parameters.

The digest (xxh3 of each parameter's raw bytes, written per rank with --digest-out DIR) is how
tests prove that ``distdebug attach`` leaves training results bitwise unchanged.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
import torch.distributed as dist


def base_parser(description: str, global_batch: bool = False) -> argparse.ArgumentParser:
    """The arguments every recipe takes; ``global_batch``: the script splits ``--global-batch`` over its ranks
    (``share``), so it takes that option too (a script that would ignore it does not accept it)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="per-rank batch size")
    if global_batch:
        p.add_argument("--global-batch", type=int, default=None,
                       help="the batch of all data-parallel ranks together, each rank taking its share of the same "
                            "samples: runs at any world size see the same data (a pair for distdebug parity); "
                            "default: --batch-size on each rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--digest-out", default=None, help="directory for per-rank parameter digests")
    return p


def setup(seed: int) -> torch.device:
    """Init the default process group (nccl on GPU, gloo on CPU), seed everything, pick the device."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    seed_all(seed)
    return device


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def share(args: argparse.Namespace, dp_size: int) -> int:
    """This rank's batch size: ``--global-batch`` split over the ``dp_size`` data-parallel ranks (which must divide
    it: the global batch is what a parity pair holds equal), else ``--batch-size``."""
    if getattr(args, "global_batch", None) is None:
        return args.batch_size
    if args.global_batch <= 0:
        raise SystemExit(f"--global-batch {args.global_batch}: give a positive number of samples")
    if args.global_batch % dp_size:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by the {dp_size} data-parallel ranks")
    return args.global_batch // dp_size


def my_rows(args: argparse.Namespace, dp_size: int, dp_rank: int, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This data-parallel rank's rows of each tensor of a ``--global-batch`` batch: ``share`` of them, in rank order
    (the ranks' rows together are the whole batch, as one rank reads it)."""
    size = share(args, dp_size)
    return tuple(t[dp_rank * size:(dp_rank + 1) * size] for t in batch)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds: DTensor shards are digested as the local shard."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def param_digest(named_params) -> str:
    """xxh3 over every parameter's name and raw bytes, in order: changes when any bit changes."""
    import xxhash

    h = xxhash.xxh3_64()
    for name, p in named_params:
        t = local_tensor(p.detach()).contiguous().cpu()
        h.update(name.encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class StepTimer:
    """Wall time between consecutive ``tick()`` calls (one per step), for the benchmarks."""

    def __init__(self) -> None:
        self.marks = [time.perf_counter()]

    def tick(self) -> None:
        self.marks.append(time.perf_counter())

    def median_s(self) -> float:
        gaps = sorted(b - a for a, b in zip(self.marks[1:-1], self.marks[2:], strict=True))  # step 1 is warm-up
        return gaps[len(gaps) // 2] if gaps else float("nan")


def write_digest(out_dir: str | None, digest: str, loss: float, timer: StepTimer | None = None) -> None:
    """Print and (with --digest-out) write ``<digest> <final loss> <median step seconds>`` for this rank."""
    rank = dist.get_rank()
    step_s = timer.median_s() if timer else float("nan")
    print(f"rank {rank}: final loss {loss:.6f} digest {digest} median step {step_s * 1000:.3f} ms", flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"{digest} {loss!r} {step_s!r}\n")


def finish() -> None:
    """End the rank: destroy the process group, flush, and leave without interpreter teardown.

    Why not just return: process groups outlive destroy_process_group() whenever something still
    holds them (torch.distributed.nn.functional's ``group=group.WORLD`` defaults, evaluated when
    torch._dynamo imports it at the first optimizer.step(); DeepSpeed's module-level group cache;
    FSDP2's state), and their gloo threads then meet interpreter teardown, where torch sometimes
    aborts the finished process ("terminate called without an active exception", exit -6;
    pytorch/pytorch#179291). Under ``distdebug attach`` the bootstrap still writes the rank's end
    record first (it sees os._exit).
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

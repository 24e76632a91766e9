"""Synthetic run directories, as attach writes them, for report tests at scales this machine cannot run
(1000 ranks, thousands of steps), with known faults planted: a slow rank, a NaN origin, killed ranks.

The records follow ``distdebug.artifacts.schema``; values are deterministic (seeded), so tests can
assert exactly where each planted fault must show.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from distdebug.artifacts import layout, schema


def write_run(root: Path, *, ranks: int, steps: int, slow_rank: int | None = None, nan_rank: int | None = None,
              nan_step: int | None = None, killed: tuple[int, ...] = (), killed_at: int | None = None,
              seed: int = 0) -> Path:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / layout.MANIFEST).write_text(json.dumps({"schema": schema.MANIFEST_SCHEMA, "command": [
        "distdebug", "attach", "--nproc-per-node", str(ranks), "train.py"]}))
    for rank in range(ranks):
        last = killed_at if rank in killed and killed_at else steps
        lines = [schema.record(schema.START, rank=rank, node=rank // 8, world_size=ranks, host=f"node{rank // 8}",
                               time=0.0)]
        if rank == 0:
            lines.append(schema.record(schema.DISCOVERY, rank=0, step=0, models=[
                {"class": "Net", "wrapper": "ddp", "parameters": 1000}], optimizers=[{"class": "SGD"}],
                process_group={"backend": "nccl"}, step_source="optimizer"))
        for step in range(1, last + 1):
            loss = 2.0 * math.exp(-step / 200) + rng.gauss(0, 0.02)
            if nan_step is not None and step >= nan_step:
                loss = math.nan
            t = 0.1 * (1 + rng.gauss(0, 0.03)) * (2.5 if rank == slow_rank else 1.0)
            lines.append(schema.record(schema.STEP, rank=rank, step=step, loss=loss, step_time_s=t,
                                       backward_calls=1, collectives=2))
        if nan_rank == rank and nan_step is not None:
            lines.append(schema.record(schema.FINDING, severity="error", detector="nan_origin", ranks=[rank],
                                       step=nan_step, subject="layers.7.mlp.weight",
                                       message=f"NaN/Inf started on rank {rank} at step {nan_step}",
                                       evidence={"origin": "this rank"}))
        mb = 2**20
        lines.append(schema.record(schema.MEMORY_PEAK, rank=rank, step=2, parameters=40 * mb, gradients=40 * mb,
                                   optimizer_state=80 * mb, activations=(300 if rank == ranks - 1 else 120) * mb,
                                   total=0))
        if rank == 0 and ranks > 1:
            scores = {str(r): {"score": 0.4 if r == slow_rank else round(0.95 + 0.05 * rng.random(), 3)}
                      for r in range(ranks)}
            lines.append(schema.record(schema.STRAGGLER_SCORES, rank=0, step=steps, ranks=scores))
            if slow_rank is not None:
                lines.append(schema.record(schema.FINDING, severity="warning", detector="straggler",
                                           ranks=[slow_rank], step=16, subject=f"rank {slow_rank}",
                                           message=f"rank {slow_rank} is a straggler", evidence={"cause": "compute"}))
        if rank not in killed:
            lines.append(schema.record(schema.END, rank=rank, exit_code=0, steps=last))
        path = layout.events_path(root, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in lines)
        if rank in killed:
            text += '{"v":1,"kind":"step","rank":' + str(rank)  # the line a SIGKILL cut in half
        path.write_text(text)
    return root

"""Tier 2 (real gloo ranks, forked): pipeline parallelism runs under the harness as without it.

``dist.P2POp`` and ``batch_isend_irecv`` check the op by identity against c10d's own ``isend`` and
``irecv`` (``op in [isend, irecv]``): a harness that wrapped only ``dist.isend`` broke every pipeline
schedule (``ValueError: Invalid op``). Each schedule runs 3 steps of 2 stages on 2 ranks, with a
Session and every default detector installed, and its final parameters must equal the bare run's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from distdebug.detectors import registry
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks


def _pipeline(rank, world, tmp, schedule, harness):
    from torch.distributed import pipelining

    s = start_session(tmp, rank, detectors=registry.build(registry.default_specs())) if harness else None
    torch.manual_seed(rank)
    module = nn.Sequential(nn.Linear(8, 8), nn.ReLU()) if rank == 0 else nn.Linear(8, 1)
    stage = pipelining.PipelineStage(module, stage_index=rank, num_stages=world, device=torch.device("cpu"))
    sched = getattr(pipelining, schedule)(stage, n_microbatches=2, loss_fn=lambda out, y: (out - y).pow(2).mean())
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()
    digest = [p.detach().double().sum().item() for p in module.parameters()]
    steps = None
    if s is not None:
        steps = s.step
        s.close(0)
    return digest, steps


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_pipeline_schedules_run_under_the_harness_bitwise_as_without(tmp_path, schedule):
    bare = spawn_ranks(_pipeline, 2, timeout=120, tmp=tmp_path / "bare", schedule=schedule, harness=False)
    under = spawn_ranks(_pipeline, 2, timeout=120, tmp=tmp_path / "attached", schedule=schedule, harness=True)
    for rank in range(2):
        assert under[rank][0] == bare[rank][0]
        assert under[rank][1] == 3  # every stage counts its optimizer steps


def _p2p(rank, world, tmp):
    import torch.distributed as dist

    s = start_session(tmp, rank, detectors=[])
    t = torch.full((2,), float(rank))
    out = torch.zeros(2)
    ops = [dist.P2POp(dist.isend, t, 1 - rank), dist.P2POp(dist.irecv, out, 1 - rank)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    s.close(0)
    return out.tolist()


def test_p2pop_built_from_the_wrapped_isend_passes_torchs_identity_check(tmp_path):
    assert spawn_ranks(_p2p, 2, timeout=60, tmp=tmp_path) == [[1.0, 1.0], [0.0, 0.0]]

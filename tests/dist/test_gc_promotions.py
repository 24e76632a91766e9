"""Tier 2 (real gloo ranks, forked): what a step leaves for the interpreter's garbage collector does not grow
with the model.

Why: CPython promotes what survives two young collections to its oldest generation, and once the objects promoted
since the last full collection pass a quarter of that generation it runs a full one, which walks every object the
process holds: 0.12 s on the 1,000-tensor bench model, a stall of one rank that every other rank waits for at its
next collective. The harness once kept about 200 tracked objects a step alive past their step there (byte views
cached for a few steps and dropped, per-step histories as lists, records kept 64 steps), one full collection every
200 steps; a run without it keeps none (issue 62).

Counted here: the tracked objects made in one step that are still alive and tracked after it (each count after a
full collection, which stops tracking tuples and dicts of plain numbers and strings, as the collector does in a
real run), with every default detector on and without the harness, at two loop shapes (one micro-batch a step,
and three with two under ``no_sync``). The parts that once kept one a tensor (byte views, pairs, rows, records)
have unit tests of their own (tests/unit/test_gc_kept.py).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

from distdebug.detectors import registry
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks

TENSORS = 400
WARM, SAMPLES = 30, 4
PER_STEP = 100
"""Tracked objects made in a step and alive after it, above the bare run, at most: the harness's own few (its
records and cross-rank batches in flight: 17 to 49 measured); a harness that kept something a tensor keeps 400."""


def _loop(rank, world, tmp, harness, micro):
    from torch.nn.parallel import DistributedDataParallel as DDP

    s = start_session(tmp, rank, detectors=registry.build(registry.default_specs())) if harness else None
    torch.manual_seed(0)
    layers = []
    for _ in range(TENSORS // 2):
        layers += [nn.Linear(4, 4), nn.Tanh()]
    model = nn.Sequential(*layers)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)

    def step():
        for m in range(micro):
            x = torch.randn(2, 4, generator=g)
            if m < micro - 1:
                with ddp.no_sync():
                    ddp(x).pow(2).mean().backward()
            else:
                ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def tracked():
        gc.collect()  # what survives it still tracked: containers the collector walks at every full collection
        return set(map(id, gc.get_objects()))

    for _ in range(WARM):
        step()
    kept = []
    for _ in range(SAMPLES):
        before = tracked()
        step()
        kept.append(len(tracked() - before))  # made in that step, alive after it
    if s is not None:
        s.close(0)
    return kept


@pytest.mark.slow  # about 25 s of CPU: four forked pairs of ranks
@pytest.mark.parametrize("micro", [1, 3])
def test_what_a_step_leaves_to_the_collector_does_not_grow_with_the_model(tmp_path, micro):
    bare = spawn_ranks(_loop, 2, timeout=600, tmp=tmp_path / "bare", harness=False, micro=micro)
    under = spawn_ranks(_loop, 2, timeout=600, tmp=tmp_path / "attached", harness=True, micro=micro)
    for rank in range(2):
        assert max(under[rank]) - max(bare[rank]) <= PER_STEP, (rank, micro, under[rank], bare[rank])

"""Tier 2 (real gloo ranks, forked): what a step leaves for the interpreter's garbage collector does not grow
with the model.

Why: CPython promotes what survives two young collections to its oldest generation, and once the objects promoted
since the last full collection pass a quarter of that generation it runs a full one, which walks every object the
process holds: 0.12 s on the 1,000-tensor bench model, a stall of one rank that every other rank waits for at its
next collective. The harness once had about 200 objects a step promoted there (byte views cached for a few steps
and dropped, (name, tensor) pairs alive while a step was judged, per-step histories as lists, records kept 64
steps), one full collection every 200 steps; a run without it has none (issue 62).

Counted here: the tracked objects made in one step that are still alive and tracked after it (each count after a
full collection, which stops tracking tuples and dicts of plain numbers and strings, as the collector does in a
real run), with every default detector on and without the harness, at two loop shapes (one micro-batch a step,
and three with two under ``no_sync``): a guard against a harness that keeps something a tensor past its step. The
parts that did (byte views at new addresses, rows, records) have unit tests of their own, which fail on the code
before (tests/unit/test_gc_kept.py); the whole harness's promotions at 1,000 tensors were measured
(docs/project/limits.md).
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.nn as nn

from distdebug.detectors import registry
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks

TENSORS = 400
WARM, SAMPLES = 20, 2
PER_STEP = 100
"""Tracked objects made in a step and alive after it, above the bare run, at most: the harness's own few (its
records and cross-rank batches in flight: 17 to 49 measured); a harness that kept something a tensor keeps 400."""


def _loop(rank, world, tmp, harness):
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
    micro = [1]

    def step():
        for m in range(micro[0]):  # all but the last micro-batch accumulate without reducing
            with ddp.no_sync() if m < micro[0] - 1 else contextlib.nullcontext():
                ddp(torch.randn(2, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def tracked():
        gc.collect()  # what survives it still tracked: containers the collector walks at every full collection
        return set(map(id, gc.get_objects()))

    kept = {}
    for shape in (1, 3):  # one micro-batch a step, then three (two under no_sync)
        micro[0] = shape
        for _ in range(WARM):
            step()
        kept[shape] = []
        for _ in range(SAMPLES):
            before = tracked()
            step()
            kept[shape].append(len(tracked() - before))  # made in that step, alive after it
    if s is not None:
        s.close(0)
    return kept


@pytest.mark.slow  # about 20 s of CPU (full collections of the test process's heap): two forked pairs of ranks
def test_what_a_step_leaves_to_the_collector_does_not_grow_with_the_model(tmp_path):
    bare = spawn_ranks(_loop, 2, timeout=600, tmp=tmp_path / "bare", harness=False)
    under = spawn_ranks(_loop, 2, timeout=600, tmp=tmp_path / "attached", harness=True)
    for rank in range(2):
        for shape in (1, 3):
            assert max(under[rank][shape]) - max(bare[rank][shape]) <= PER_STEP, (rank, shape, under, bare)

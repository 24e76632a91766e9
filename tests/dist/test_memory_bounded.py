"""Tier 2 (real gloo ranks, forked): the harness's memory stays flat whatever the loop does between
optimizer steps: 100,000 evaluation (no_grad) forwards, 100,000 training-mode forwards without a
backward, and a loop of backward calls that never steps. Every default detector is on; the same
loop without the harness is the baseline. RSS is read with psutil in each rank, before and after
each phase (both sides run in the same way, so allocator noise is on both).

Needs: 30,000 forwards a phase (3,000 backward calls): a harness that kept anything per call would grow
by its size times that count; the bound is LIMIT_MB over FORWARDS, 524 bytes a call, the same bound
100,000 forwards under 50 MB gave, in under a third of the time."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch
import torch.nn as nn

from distdebug.detectors import registry
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks

FORWARDS = 30_000
LIMIT_MB = 15


def _rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def _loop(rank, world, tmp, harness):
    from torch.nn.parallel import DistributedDataParallel as DDP

    s = start_session(tmp, rank, detectors=registry.build(registry.default_specs())) if harness else None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))

    def step():
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    growth = {}
    before = _rss_mb()
    model.eval()
    with torch.no_grad():
        for _ in range(FORWARDS):  # a validation loop between two steps
            model(x)
    model.train()
    growth["no_grad"] = _rss_mb() - before
    before = _rss_mb()
    for _ in range(FORWARDS):  # training-mode forwards, no backward (e.g. a probe of activations)
        model(x)
    growth["train_forward"] = _rss_mb() - before
    step()
    before = _rss_mb()
    for _ in range(FORWARDS // 10):  # backward calls that never reach an optimizer step
        model(x).pow(2).mean().backward()
    growth["backward_no_step"] = _rss_mb() - before
    opt.zero_grad()
    step()
    if s is not None:
        s.close(0)
    return growth


@pytest.mark.slow  # 15 s CPU a side, the longest test of its tier: kept out of the quick one (-m "not slow")
def test_memory_stays_flat_between_steps_whatever_the_loop_does(tmp_path):
    bare = spawn_ranks(_loop, 2, timeout=600, tmp=tmp_path / "bare", harness=False)
    under = spawn_ranks(_loop, 2, timeout=600, tmp=tmp_path / "attached", harness=True)
    for rank in range(2):
        for phase, grown in under[rank].items():
            assert grown - bare[rank][phase] < LIMIT_MB, (rank, phase, under[rank], bare[rank])


def _fresh_wrappers(rank, world, tmp, harness):
    """A fresh DDP wrapper and a fresh optimizer every step (as some Trainer subclasses do)."""
    import weakref

    from torch.nn.parallel import DistributedDataParallel as DDP

    s = start_session(tmp, rank, detectors=registry.build(registry.default_specs())) if harness else None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    wrappers = []
    for step in range(1, 6):
        ddp = DDP(model)
        wrappers.append(weakref.ref(ddp))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    del ddp, opt
    gc.collect()
    alive = [w() is not None for w in wrappers]
    digest = [float(p.detach().double().sum()) for p in model.parameters()]
    steps = None
    if s is not None:
        steps = s.step
        s.close(0)
    return alive, digest, steps


def test_no_strong_reference_to_the_users_wrappers_or_optimizers(tmp_path):
    bare = spawn_ranks(_fresh_wrappers, 2, timeout=120, tmp=tmp_path / "bare", harness=False)
    under = spawn_ranks(_fresh_wrappers, 2, timeout=120, tmp=tmp_path / "attached", harness=True)
    for rank in range(2):
        alive, digest, steps = under[rank]
        assert alive == [False] * 5, alive  # every dropped DDP wrapper (and its reducer's hooks) freed
        assert digest == bare[rank][1]  # training untouched
        assert steps == 5  # each step's new optimizer marks its boundary once the previous one is gone

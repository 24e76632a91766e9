"""Tier 2 (real gloo ranks, forked): initial parameters compared across ranks before anything syncs them."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from distdebug.detectors.init_seed import InitSeed
from tests.dist.test_replica_divergence import findings
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks


def _loop(rank, world, tmp, seed_per_rank=False, ddp=False, seed=True):
    from torch.nn.parallel import DistributedDataParallel as DDP

    s = start_session(tmp, rank, detectors=[InitSeed()])
    if seed:
        torch.manual_seed(rank if seed_per_rank else 0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    net = DDP(model) if ddp else model
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        net(torch.ones(2, 4)).sum().backward()
        if not ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    s.close(0)


def test_same_seed_no_finding(tmp_path):
    spawn_ranks(_loop, 2, tmp=tmp_path)
    assert findings(tmp_path, 0) == []


def test_different_init_in_a_hand_written_loop_is_an_error_naming_tensors(tmp_path):
    spawn_ranks(_loop, 2, tmp=tmp_path, seed_per_rank=True)
    (f,) = findings(tmp_path, 0)
    assert (f["detector"], f["severity"], f["step"], f["subject"], f["ranks"]) == \
        ("init_seed", "error", 0, "0.weight", [0, 1])
    assert "nothing broadcasts them" in f["message"] and "2.bias" in f["evidence"]["tensors"]


def test_per_rank_seeds_that_ddp_equalises_are_no_finding_and_unseeded_is_an_info(tmp_path):
    # Seeding each rank differently on purpose is fine under DDP: its broadcast made the replicas equal.
    spawn_ranks(_loop, 2, tmp=tmp_path / "ddp", seed_per_rank=True, ddp=True)
    assert findings(tmp_path / "ddp", 0) == [] and findings(tmp_path / "ddp", 1) == []
    spawn_ranks(_loop, 2, tmp=tmp_path / "unseeded", seed=False, ddp=True)
    (f,) = findings(tmp_path / "unseeded", 0)
    assert (f["severity"], f["subject"]) == ("info", "torch.manual_seed")
    assert "torch.manual_seed was never called" in f["message"]

"""Tier 2 (real gloo ranks, forked): lint's checks on the live DDP objects, after step 1."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distdebug.detectors.config_lint import ConfigLint
from tests.dist.test_replica_divergence import findings
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 1)
        self.spare = nn.Linear(4, 1)  # never called

    def forward(self, x):
        return self.used(x)


def _loop(rank, world, tmp, case):
    s = start_session(tmp, rank, detectors=[ConfigLint()])
    torch.manual_seed(0)
    if case == "unused":
        model = DDP(Branchy(), find_unused_parameters=True)
    elif case == "all_used":
        model = DDP(nn.Linear(4, 1), find_unused_parameters=True)
    elif case == "buffers":
        model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)), broadcast_buffers=False)
    elif case == "compile_first":
        model = DDP(torch.compile(nn.Linear(4, 1), backend="eager"))
    else:
        model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    s.close(0)


def run(tmp_path, case):
    spawn_ranks(_loop, 2, tmp=tmp_path, case=case)
    return [(f["severity"], f["subject"], f["step"], f["ranks"]) for f in findings(tmp_path, 1)], findings(tmp_path, 1)


def test_find_unused_parameters_is_judged_by_the_real_gradients(tmp_path):
    got, fs = run(tmp_path / "all", "all_used")
    assert got == [("warning", "find_unused_parameters", 1, [1])] and "wasted" in fs[0]["message"]
    got, fs = run(tmp_path / "unused", "unused")
    assert got == [("info", "find_unused_parameters", 1, [1])]
    assert fs[0]["evidence"]["unused"] == ["spare.weight", "spare.bias"]


def test_buffers_compile_order_and_a_clean_model(tmp_path):
    got, fs = run(tmp_path / "b", "buffers")
    assert got == [("warning", "broadcast_buffers", 1, [1])] and fs[0]["evidence"]["modules"] == ["1"]
    got, _ = run(tmp_path / "c", "compile_first")
    assert got == [("warning", "torch.compile before DDP", 1, [1])]
    got, _ = run(tmp_path / "clean", "clean")
    assert got == []

"""Tier 2 (real gloo ranks, forked): BatchNorm statistics compared across ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from distdebug.detectors.bn_divergence import BatchNormDivergence, batch_mean_spread
from tests.dist.test_replica_divergence import findings
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks


def test_batch_mean_spread_in_pooled_std_units():
    stats = {0: {"mean": [0.0, 1.0], "var": [1.0, 4.0]}, 1: {"mean": [0.5, 1.0], "var": [1.0, 4.0]}}
    spread, channel = batch_mean_spread(stats)
    assert channel == 0 and abs(spread - 0.25 / (1 + 1e-5) ** 0.5) < 1e-9


def test_syncbatchnorm_is_never_told_to_use_syncbatchnorm():
    # SyncBatchNorm under DDP needs GPUs, so this branch is checked on synthetic per-rank statistics.
    det = BatchNormDivergence()
    det.modules = [("bn", nn.BatchNorm1d(2), True), ("plain", nn.BatchNorm1d(2), False)]
    skewed = {"mean": [0.0, 0.0], "var": [1.0, 1.0]}
    per_rank = {0: {"bn": skewed, "plain": skewed}, 1: {"bn": {**skewed, "mean": [3.0, 0.0]},
                                                        "plain": {**skewed, "mean": [3.0, 0.0]}}}
    (f,) = det._compare(5, per_rank)
    assert (f.subject, f.step, f.evidence["channel"]) == ("plain", 5, 0)


def _bn(rank, world, tmp, broadcast_buffers=True, skew=0.0, steps=4):
    from torch.nn.parallel import DistributedDataParallel as DDP

    s = start_session(tmp, rank, detectors=[BatchNormDivergence()])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    ddp = DDP(model, broadcast_buffers=broadcast_buffers)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(256, 4, generator=g) + skew * rank  # skew: rank r's data shifted by r * skew
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
    s.close(0)


def test_broadcast_buffers_false_names_the_module_and_ranks(tmp_path):
    spawn_ranks(_bn, 2, tmp=tmp_path, broadcast_buffers=False)
    (f,) = findings(tmp_path, 0)
    assert (f["detector"], f["severity"], f["step"], f["subject"], f["ranks"]) == \
        ("bn_divergence", "error", 2, "1", [0, 1])
    assert f["evidence"]["max_abs_diff"]["running_mean"] > 0 and "broadcast_buffers" in f["fix"]


def test_plain_batchnorm_with_skewed_ranks_recommends_syncbatchnorm(tmp_path):
    spawn_ranks(_bn, 2, tmp=tmp_path / "plain", skew=2.0)
    (f,) = findings(tmp_path / "plain", 0)
    assert (f["severity"], f["step"], f["subject"]) == ("warning", 2, "1")
    assert "SyncBatchNorm: not in use" in f["message"] and "convert_sync_batchnorm" in f["fix"]


def test_clean_ddp_with_batchnorm_has_no_finding(tmp_path):
    spawn_ranks(_bn, 3, tmp=tmp_path, steps=9)
    assert [findings(tmp_path, r) for r in range(3)] == [[], [], []]

"""Tier 2 (real gloo ranks, forked): checkpoint round trips through torch.save / torch.load."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from distdebug.detectors.checkpoint_roundtrip import CheckpointRoundTrip, compare_saved, tensor_items
from tests.dist.test_replica_divergence import findings
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks


def test_tensor_items_and_compare():
    obj = {"model": {"w": torch.ones(2)}, "opt": {"state": {0: {"exp_avg": torch.zeros(2)}}}, "lst": [torch.ones(1)],
           "epoch": 3}
    assert [k for k, _ in tensor_items(obj)] == ["model.w", "opt.state.0.exp_avg", "lst[0]"]
    assert compare_saved({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == {"differ": ["b"], "missing": [], "extra": ["c"]}


def _roundtrip(rank, world, tmp, fault=None):
    s = start_session(tmp, rank, detectors=[CheckpointRoundTrip()])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    path = tmp / f"ckpt_{rank}.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    if fault == "corrupt" and rank == 1:
        state = torch.load(path)
        state["model"]["0.bias"][2] += 1e-3
        torch.serialization.save(state, path)  # changed behind the harness's back
    dist.barrier()
    load_from = tmp / "ckpt_0.pt" if fault == "wrong_shard" and rank == 1 else path
    restored = torch.load(load_from)
    model.load_state_dict(restored["model"])
    s.close(0)


def test_clean_round_trip_has_no_finding(tmp_path):
    spawn_ranks(_roundtrip, 2, tmp=tmp_path)
    assert findings(tmp_path, 0) == [] and findings(tmp_path, 1) == []


def test_tensor_changed_between_save_and_load_is_named(tmp_path):
    spawn_ranks(_roundtrip, 2, tmp=tmp_path, fault="corrupt")
    assert findings(tmp_path, 0) == []
    (f,) = findings(tmp_path, 1)
    assert (f["detector"], f["subject"], f["ranks"]) == ("checkpoint_roundtrip", "model.0.bias", [1])
    assert f["evidence"]["differ"] == ["model.0.bias"] and f["evidence"]["missing"] == []


def test_wrong_shard_restored_is_named(tmp_path):
    spawn_ranks(_roundtrip, 2, tmp=tmp_path, fault="wrong_shard")
    (f,) = findings(tmp_path, 1)
    assert f["subject"] == "ckpt_0.pt" and f["ranks"] == [1]
    assert "rank 1 restored ckpt_0.pt, which rank 0 saved" in f["message"]

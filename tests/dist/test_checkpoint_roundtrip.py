"""Tier 2 (real gloo ranks, forked): checkpoint round trips through torch.save / torch.load."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from distdebug.artifacts import layout
from distdebug.detectors.checkpoint_roundtrip import CheckpointRoundTrip, compare_saved, siblings, tensor_items
from tests.dist.test_replica_divergence import findings
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks


def test_tensor_items_and_compare():
    obj = {"model": {"w": torch.ones(2)}, "opt": {"state": {0: {"exp_avg": torch.zeros(2)}}}, "lst": [torch.ones(1)],
           "epoch": 3}
    assert [k for k, _ in tensor_items(obj)] == ["model.w", "opt.state.0.exp_avg", "lst[0]"]
    assert compare_saved({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == {"differ": ["b"], "missing": [], "extra": ["c"]}
    assert siblings("/c/ckpt_0.pt", "/c/ckpt_1.pt") and not siblings("/c/ckpt_0.pt", "/d/ckpt_1.pt")
    assert not siblings("/c/mp_rank_00_model_states.pt", "/c/zero_pp_rank_1_mp_rank_00_optim_states.pt")


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


def test_import_hook_patches_a_module_when_the_script_imports_it(tmp_path, monkeypatch):
    from distdebug.detectors.checkpoint_roundtrip import _ImportHook

    (tmp_path / "late_mod_for_hook.py").write_text("def save():\n    return 'original'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    hook = _ImportHook("late_mod_for_hook", lambda m: seen.append(m.save()))
    sys.meta_path.insert(0, hook)
    try:
        import late_mod_for_hook  # noqa: F401
    finally:
        sys.modules.pop("late_mod_for_hook", None)
    assert seen == ["original"] and hook not in sys.meta_path


def _dcp(rank, world, tmp, fault=None):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import save as unwatched_save
    from torch.distributed.fsdp import fully_shard

    s = start_session(tmp / "run", rank, detectors=[CheckpointRoundTrip()])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    dcp.save(model.state_dict(), checkpoint_id=str(tmp / "dcp"))
    if fault == "corrupt":  # rewritten behind the harness's back: rank 1's shard of 2.weight altered
        sd = model.state_dict()
        if rank == 1:
            with torch.no_grad():
                sd["2.weight"].to_local().view(-1)[0] += 1.0
        unwatched_save(sd, checkpoint_id=str(tmp / "dcp"))
    target = model.state_dict()
    dcp.load(target, checkpoint_id=str(tmp / "dcp"))
    s.close(0)


def test_dcp_round_trip_compares_each_ranks_shards(tmp_path):
    spawn_ranks(_dcp, 2, tmp=tmp_path / "clean", timeout=120)
    assert findings(tmp_path / "clean" / "run", 0) == [] and findings(tmp_path / "clean" / "run", 1) == []
    spawn_ranks(_dcp, 2, tmp=tmp_path / "fault", fault="corrupt", timeout=120)
    assert findings(tmp_path / "fault" / "run", 0) == []
    (f,) = findings(tmp_path / "fault" / "run", 1)
    assert (f["detector"], f["subject"], f["ranks"], f["evidence"]["differ"]) == \
        ("checkpoint_roundtrip", "2.weight", [1], ["2.weight"])


def _restart(rank, world, tmp, run, ckpt, corrupt_after=False):
    (tmp / run).mkdir(parents=True, exist_ok=True)
    (tmp / run / layout.MANIFEST).write_text("{}")  # a run directory, as attach makes one
    s = start_session(tmp / run, rank, detectors=[CheckpointRoundTrip()])
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    path = ckpt / f"ckpt_{rank}.pt"
    if run == "a":
        torch.save(model.state_dict(), path)
        dist.barrier()
        if corrupt_after and rank == 0:
            st = os.stat(path)
            state = torch.serialization.load(path)
            state["bias"][1] += 1.0  # same size: silent corruption on disk
            torch.serialization.save(state, path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        model.load_state_dict(torch.load(ckpt / "ckpt_0.pt" if rank == 1 else path))
    s.close(0)


def test_restart_compares_with_the_save_of_an_earlier_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    spawn_ranks(_restart, 2, tmp=tmp_path / "runs", run="a", ckpt=ckpt, corrupt_after=True)
    spawn_ranks(_restart, 2, tmp=tmp_path / "runs", run="b", ckpt=ckpt)
    b = tmp_path / "runs" / "b"
    (f0,) = findings(b, 0)
    assert (f0["subject"], f0["ranks"], f0["severity"]) == ("bias", [0], "error")
    assert "what rank 0 saved at step 0 of run a" in f0["message"] and f0["evidence"]["differ"] == ["bias"]
    # rank 1 restarts from rank 0's file although it saved its own in run a: the wrong shard
    msgs = sorted(f["message"] for f in findings(b, 1))
    assert any("rank 1 restored ckpt_0.pt, which rank 0 saved" in m for m in msgs), msgs

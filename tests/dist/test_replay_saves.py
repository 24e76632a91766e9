"""Tier 2 (2 gloo ranks, a tiny model): on a script replay's clean run (DISTDEBUG_REPLAY_BACKUP set), the probe
keeps, before the first torch.save to each path outside the replay's work dir, whether the path existed and the
file that was there, once for all ranks (issue 46); the replay puts those paths back between runs
(fault_injection.sandbox; its file operations are tested in tests/unit/test_sandbox.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distdebug import envvars
from distdebug.fault_injection.probe import Probe
from distdebug.fault_injection.sandbox import BACKUP_FOLDER, restore, saved_outside
from tests.dist.test_session import records, start_session
from tests.helpers import spawn_ranks


def _saves(rank, world, tmp, outside, work, backed_up):
    if backed_up:
        os.environ[envvars.REPLAY_BACKUP] = str(Path(work) / BACKUP_FOLDER)
    s = start_session(tmp, rank, detectors=[Probe()])
    model = nn.Linear(2, 1)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(outside, "user.pt"))  # overwrites the user's file
        torch.save(model.state_dict(), os.path.join(outside, "new.pt"))
        torch.save(model.state_dict(), os.path.join(work, "copy", "snapshot.pt"))  # in the run's copy
        # An atomic save: the rename overwrites the user's file, never torch.saved to by its own name.
        torch.save(model.state_dict(), os.path.join(outside, "atomic.pt.tmp"))
        os.replace(os.path.join(outside, "atomic.pt.tmp"), os.path.join(outside, "atomic.pt"))
        os.replace(os.path.join(outside, "moved.src"), os.path.join(outside, "moved.dst"))  # not torch.save's
    dist.barrier()
    if rank == 1:  # after rank 0 wrote it: what was there before the run is kept, not rank 0's
        torch.save({"w": model.weight.detach()}, os.path.join(outside, "user.pt"))
    dist.barrier()
    s.close(0)


@pytest.mark.slow  # two ranks for one replay property: full suite only (the quick tier's 5 minutes are full)
def test_the_clean_run_keeps_what_was_at_each_path_it_saves_to_outside_and_the_replay_puts_it_back(tmp_path):
    outside, work = tmp_path / "ckpt", tmp_path / "work"
    outside.mkdir()
    (work / "copy").mkdir(parents=True)
    (outside / "user.pt").write_bytes(b"the user's checkpoint")
    (outside / "atomic.pt").write_bytes(b"the user's atomic checkpoint")
    (outside / "moved.src").write_bytes(b"a cache")
    spawn_ranks(_saves, 2, tmp=tmp_path / "run", outside=str(outside), work=str(work), backed_up=True)
    saves = {(r["rank"], Path(r["path"]).name): r["existed"] for rank in (0, 1)
             for r in records(tmp_path / "run", rank, "probe") if r["fact"] == "save"}
    assert saves == {(0, "user.pt"): True, (0, "new.pt"): False, (0, "snapshot.pt"): False,
                     (0, "atomic.pt.tmp"): False, (1, "user.pt"): True}
    saved = saved_outside(work / BACKUP_FOLDER)
    assert [(Path(s.path).name, s.existed) for s in saved] == [("atomic.pt", True), ("atomic.pt.tmp", False),
                                                               ("new.pt", False), ("user.pt", True)]
    assert restore(saved) == []
    assert sorted(p.name for p in outside.iterdir()) == ["atomic.pt", "moved.dst", "user.pt"]
    assert (outside / "user.pt").read_bytes() == b"the user's checkpoint"
    assert (outside / "atomic.pt").read_bytes() == b"the user's atomic checkpoint"
    assert (work / "copy" / "snapshot.pt").is_file()  # the copy's own: removed with the copy, never restored


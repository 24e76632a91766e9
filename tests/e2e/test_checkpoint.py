"""Tier 3 (end to end): DeepSpeed checkpoints under attach, saved, restored in place, and restored by a
later run after the file was corrupted on disk.

Needs: 2 ranks (ZeRO partitions the optimizer state: the shard of each rank is checked); 4 steps with a
save and an in-place restore, then a 2-step run restoring the corrupted file (the restore is the subject,
not the training)."""

from __future__ import annotations

import json
import os

import torch

from distdebug.artifacts import layout
from tests.e2e.test_attach import kinds
from tests.helpers import RECIPES, distdebug


def test_deepspeed_checkpoint_round_trip_and_restart_from_a_corrupted_file(tmp_path):
    runs, ckpt = tmp_path / "runs", tmp_path / "ckpt"
    recipe = [str(RECIPES / "deepspeed_zero.py"), "--zero-stage", "2", "--checkpoint-dir", str(ckpt)]
    r = distdebug("attach", "--run-dir", str(runs / "a"), *recipe, "--steps", "4", "--checkpoint-at", "3")
    assert r.returncode == 0, r.output
    # Saved and loaded back in place: every file matches, and reading the other ranks' ZeRO files
    # (DeepSpeed's elastic load) is not mistaken for restoring the wrong shard.
    assert [f for rank in (0, 1) for f in kinds(runs / "a", rank, "finding")] == []
    saved = [json.loads(line)["path"] for line in
             (layout.rank_dir(runs / "a", 0) / layout.CHECKPOINTS).read_text().splitlines()]
    model_file = ckpt / "step3" / "mp_rank_00_model_states.pt"
    assert str(model_file) in saved

    st = os.stat(model_file)
    state = torch.serialization.load(model_file, weights_only=False)
    state["module"]["2.bias"][5] += 1.0  # silent corruption: same size, same modification time
    torch.serialization.save(state, model_file)
    os.utime(model_file, ns=(st.st_atime_ns, st.st_mtime_ns))

    r = distdebug("attach", "--run-dir", str(runs / "b"), *recipe, "--steps", "2", "--resume")
    assert r.returncode == 0, r.output  # the harness reports; the training goes on
    for rank in (0, 1):
        (f,) = kinds(runs / "b", rank, "finding")
        assert (f["detector"], f["severity"], f["subject"], f["ranks"]) == \
            ("checkpoint_roundtrip", "error", "module.2.bias", [rank])
        assert "mp_rank_00_model_states.pt does not match what rank 0 saved at step 3 of run a" in f["message"]
    r = distdebug("report", str(runs / "b"))
    assert "module.2.bias" in r.output

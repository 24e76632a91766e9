"""Tier 3 (CLI): real loop shapes under attach give no finding and train bitwise as under torchrun.

LR scheduler, gradient clipping, validation with model.eval() between steps, a no_grad inference
phase, an EMA copy, frozen parameters, a parameter group added later, gradient accumulation with
no_sync(), tied weights; a DataLoader with 2 persistent workers, activation checkpointing, bf16
autocast, optimizer.step(closure); a GAN's two models and optimizers (tests/data/scripts/loop_shapes.py)."""

from __future__ import annotations

import pytest

from tests.e2e.test_attach import kinds
from tests.helpers import DATA, distdebug, read_digests, torchrun

SCRIPT = str(DATA / "scripts" / "loop_shapes.py")


@pytest.mark.parametrize("shapes", [
    "sched,clip,eval,infer,ema,frozen,late,accum,tied",
    "workers,ckpt,bf16,closure",
    "gan",
])
def test_loop_shape_is_clean_and_bitwise_torchruns(shapes, tmp_path):
    args = ["--shapes", shapes, "--steps", "12"]
    ref = torchrun(SCRIPT, *args, "--digest-out", str(tmp_path / "ref"), timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    r = distdebug("attach", "--run-dir", str(tmp_path / "run"), SCRIPT, *args, "--digest-out", str(tmp_path / "att"),
                  timeout=300)
    assert r.returncode == 0, r.output[-3000:]
    assert read_digests(tmp_path / "att") == read_digests(tmp_path / "ref")
    found = [f"{f['detector']} rank {f['rank']} step {f['step']}: {f['message']}"
             for rank in (0, 1) for f in kinds(tmp_path / "run", rank, "finding")]
    assert found == []
    assert [s["step"] for s in kinds(tmp_path / "run", 0, "step")] == list(range(1, 13))

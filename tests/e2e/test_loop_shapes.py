"""Tier 3 (CLI): real loop shapes under attach give no finding and train bitwise as under torchrun.

LR scheduler, gradient clipping, validation with model.eval() between steps, a no_grad inference
phase, an EMA copy, frozen parameters, a parameter group added later, gradient accumulation with
no_sync(), tied weights; a DataLoader with 2 persistent workers, activation checkpointing, bf16
autocast, optimizer.step(closure); a GAN's two models and optimizers; a second training phase with a new
model and optimizer, the first kept alive or dropped (tests/data/scripts/loop_shapes.py).

Needs: 2 ranks and 12 steps: each shape (validation every few steps, an EMA update, a parameter group
added at a step, accumulation over 2 micro-batches) happens several times inside the run."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_attach import kinds
from tests.helpers import DATA, distdebug, read_digests, torchrun

SCRIPT = str(DATA / "scripts" / "loop_shapes.py")


@pytest.mark.parametrize("shapes", [
    "sched,clip,eval,infer,ema,frozen,late,accum,tied",
    "workers,ckpt,bf16,closure",
    "gan",
    "phase2",
    "rebuild,accum,clip",
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


@pytest.mark.parametrize("shapes", ["phase2", "rebuild"])
@pytest.mark.parametrize("fault,detector,ranks,subject", [
    ("bitflip_param:rank=1,step=10", "replica_divergence", [0, 1], "extra.weight"),  # 2 ranks: no majority
    ("nan_activation:rank=1,step=10", "nan_origin", [1], "head"),
])
def test_a_second_phase_is_watched(shapes, fault, detector, ranks, subject, tmp_path):
    """A new model and optimizer halfway (steps 7-12): the harness follows them (their discovery is step 8;
    step 9 when the old optimizer is kept alive: the new one is told apart after two steps) and a fault in
    the second phase is caught with its rank, step and subject, as in the first; steps count as the script's."""
    run = tmp_path / "run"
    r = distdebug("attach", "--run-dir", str(run), "--inject", fault, SCRIPT, "--shapes", shapes, "--steps", "12",
                  timeout=300)
    assert r.returncode == 0, r.output[-3000:]
    assert [s["step"] for s in kinds(run, 0, "step")] == list(range(1, 13))
    assert [d["step"] for d in kinds(run, 1, "discovery")] == [1, 9 if shapes == "phase2" else 8]
    errors = [(f["detector"], f["step"], f["subject"]) for rank in (0, 1) for f in kinds(run, rank, "finding")
              if f["detector"] == detector and f["severity"] == "error"]
    assert errors and set(errors) == {(detector, 10, subject)}, errors
    report = json.loads(distdebug("report", "--json", str(run)).stdout)
    first = next(f for f in report["findings"] if f["detector"] == detector and f["severity"] == "error")
    assert (first["ranks"], first["step"], first["subject"]) == (ranks, 10, subject)

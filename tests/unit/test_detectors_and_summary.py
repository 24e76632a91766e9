"""Tier 1 (pure): detector registry, the loss_nonfinite detector, and finding merge in the summary."""

from __future__ import annotations

import pytest

from distdebug.analysis.summary import summarize
from distdebug.artifacts import layout, schema
from distdebug.artifacts.reader import load_run
from distdebug.artifacts.writer import EventWriter
from distdebug.context import StepEvent
from distdebug.detectors import registry
from distdebug.detectors.base import Detector
from distdebug.detectors.loss_nonfinite import LossNonFinite
from distdebug.errors import UserError
from distdebug.findings import Finding, Severity


def ev(step, loss, rank=0):
    return StepEvent(rank=rank, step=step, loss=loss, step_time_s=0.01, backward_calls=1, collectives=0)


def test_loss_nonfinite_names_first_step_once_then_counts():
    d = LossNonFinite()
    assert list(d.on_step(ev(1, 2.0, rank=1))) == []
    (f,) = d.on_step(ev(2, float("nan"), rank=1))
    assert (f.detector, f.ranks, f.step, f.subject, f.severity) == ("loss_nonfinite", [1], 2, "loss", Severity.ERROR)
    assert list(d.on_step(ev(3, float("inf"), rank=1))) == []
    (summary,) = d.on_end()
    assert summary.evidence["nonfinite_steps"] == 2 and summary.step == 2


def test_loss_nonfinite_is_silent_on_finite_and_missing_losses():
    d = LossNonFinite()
    for i, loss in enumerate([3.0, None, 1e30, -2.0], 1):
        assert list(d.on_step(ev(i, loss))) == []
    assert list(d.on_end()) == []


def test_registry_defaults_validation_and_plugins(tmp_path):
    assert "loss_nonfinite" in registry.names()
    assert "loss_nonfinite" in registry.default_specs()
    with pytest.raises(UserError, match="unknown detector 'nope'"):
        registry.validate(["nope"])
    with pytest.raises(UserError, match="detector file not found"):
        registry.validate([f"{tmp_path}/missing.py:X"])
    plugin = tmp_path / "mydet.py"
    plugin.write_text(
        "from distdebug.detectors.base import Detector\n"
        "class Mine(Detector):\n    name = 'mine'\n"
        "class NotOne:\n    pass\n"
    )
    (det,) = registry.build([f"{plugin}:Mine"])
    assert isinstance(det, Detector) and det.name == "mine"
    with pytest.raises(UserError, match="does not name a"):
        registry.build([f"{plugin}:NotOne"])


def test_finding_round_trip():
    f = Finding(severity=Severity.WARNING, detector="d", ranks=[2], step=7, subject="layer.weight",
                message="m", evidence={"x": 1}, fix="do y")
    assert Finding.from_dict(f.to_dict()) == f


def _write_rank(run_dir, rank, steps, findings=(), end=True):
    w = EventWriter(layout.events_path(run_dir, rank))
    w.write(schema.record(schema.START, rank=rank, world_size=2, node=0, host="h"))
    for s, loss in steps:
        w.write(schema.record(schema.STEP, rank=rank, step=s, loss=loss, step_time_s=0.1 * s))
    for f in findings:
        w.write(schema.record(schema.FINDING, rank=rank, **f.to_dict()))
    if end:
        w.write(schema.record(schema.END, rank=rank, exit_code=0, steps=len(steps)))
    w.close()


def test_summary_merges_findings_across_ranks_and_reads_partial_ranks(tmp_path):
    same = dict(detector="loss_nonfinite", step=3, subject="loss", message="loss is nan at step 3")
    _write_rank(tmp_path, 0, [(1, 2.0), (2, 1.5), (3, float("nan"))],
                [Finding(severity=Severity.ERROR, ranks=[0], **same)])
    _write_rank(tmp_path, 1, [(1, 2.1), (2, 1.4)],
                [Finding(severity=Severity.ERROR, ranks=[1], **same),
                 Finding(severity=Severity.CRITICAL, detector="harness", ranks=[1], step=2, subject="x", message="y")],
                end=False)
    s = summarize(load_run(tmp_path))
    assert [f.severity for f in s.findings] == [Severity.CRITICAL, Severity.ERROR]
    assert s.findings[1].ranks == [0, 1]
    r0, r1 = s.ranks
    assert (r0.steps, r0.first_loss, r0.status) == (3, 2.0, "exit 0")
    assert r1.steps == 2 and r1.last_loss == 1.4 and r1.status.startswith("no end record")
    assert r0.median_step_time_s == pytest.approx(0.2)

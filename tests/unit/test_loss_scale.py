"""Tier 1 (pure): loss_scale's records from step events (skipped steps and scales)."""

from __future__ import annotations

from distdebug.config import LossScaleConfig
from distdebug.context import StepEvent
from distdebug.detectors.loss_scale import LossScale


def ev(step, scale, skipped=False):
    return StepEvent(rank=0, step=step, loss=1.0, step_time_s=0.0, backward_calls=1, collectives=0,
                     skipped=skipped, loss_scale=scale)


def test_a_skipped_step_is_said_at_the_next_with_both_scales():
    d = LossScale()
    assert list(d.on_step(ev(1, 65536.0, skipped=True))) == []
    (f,) = d.on_step(ev(2, 32768.0))
    assert (f.severity.value, f.step, f.subject) == ("info", 1, "skipped step")
    assert f.message.startswith("scaler skipped step 1: scale 65536 -> 32768")
    assert list(d.on_step(ev(3, 32768.0))) == []
    assert list(d.on_end()) == []


def test_a_collapsing_scale_warns_once_naming_the_steps():
    d = LossScale(LossScaleConfig(skipped_in_a_row=3, min_scale=1.0))
    out = []
    scale = 8.0
    for step in range(1, 9):
        out += d.on_step(ev(step, scale, skipped=step >= 3))
        if step >= 3:
            scale /= 2
    warnings = [(f.step, f.evidence.get("skipped_steps")) for f in out if f.severity.value == "warning"]
    assert warnings[0] == (3, [3, 4, 5])  # three in a row, from step 3
    low = [f for f in out if f.severity.value == "warning" and "fell to" in f.message]
    assert len(low) == 1 and low[0].step == 7 and low[0].evidence["loss_scale"] == 0.5
    assert len(warnings) == 2


def test_no_scaler_no_record():
    d = LossScale()
    assert [f for s in range(1, 30) for f in d.on_step(ev(s, None))] == []

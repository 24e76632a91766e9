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


def test_the_scales_calibration_at_the_start_is_no_warning_and_a_search_that_finds_none_is():
    """PyTorch's GradScaler: "the scale factor often causes infs/NaNs to appear in gradients for the first few
    iterations as its value calibrates". From Megatron's initial 2^32 that is 14 skips before 2^18 fits:
    each an info record, no warning; the same skips after an applied step are a collapsing scale."""
    d = LossScale()
    out, scale = [], 2.0 ** 32
    for step in range(1, 31):
        skipped = step <= 14
        out += d.on_step(ev(step, scale, skipped=skipped))
        scale = scale / 2 if skipped else scale
    assert [f.severity.value for f in out] == ["info"] * 14
    assert [f.step for f in out] == list(range(1, 15))
    # The same run of skips once a step has been applied: the scale keeps collapsing.
    for step in range(31, 40):
        out += d.on_step(ev(step, scale, skipped=True))
        scale /= 2
    (w,) = [f for f in out if f.severity.value == "warning"]
    assert (w.step, w.evidence["skipped_steps"]) == (31, [31, 32, 33, 34, 35])
    # A search that never finds a scale (a NaN in every backward from step 1) is a warning once below 1.
    d, out, scale = LossScale(), [], 65536.0
    for step in range(1, 21):
        out += d.on_step(ev(step, scale, skipped=True))
        scale /= 2
    (w,) = [f for f in out if f.severity.value == "warning"]
    assert w.step == 18 and w.evidence["loss_scale"] == 0.5, w
    assert "no step has been applied yet" in w.message

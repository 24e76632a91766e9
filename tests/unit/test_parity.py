"""Tier 1 (pure): the parity comparison's arithmetic (distdebug/analysis/parity.py): a band from the reference's
twin, observed/bound per quantity and step, the first departure named (issue 50's second brick)."""

from __future__ import annotations

import math

from distdebug.analysis.parity import band, compare, floor_of, gradient_scale

ORDER = ["grad:0.weight", "grad:2.weight", "param:0.weight", "param:2.weight", "grad_norm", "loss"]


def drift(steps, start, growth):
    """Benign rounding drift: starts at ``start`` and grows by ``growth`` a step (as chaotic training amplifies)."""
    return {t: start * growth ** (t - 1) for t in steps}


def runs(steps, cand_scale=1.0, fault=None):
    """(cand, twin, sizes): the candidate drifts like the twin, ``cand_scale`` times as much; ``fault``:
    (quantity, step, factor) multiplies the candidate's distance from that step on."""
    twin = {q: drift(steps, 1e-7, 1.3) for q in ORDER}
    cand = {q: {t: v * cand_scale for t, v in s.items()} for q, s in twin.items()}
    if fault is not None:
        q, at, factor = fault
        cand[q] = {t: v * (factor if t >= at else 1) for t, v in cand[q].items()}
    sizes = {q: {t: 1.0 for t in steps} for q in ORDER}
    return cand, twin, sizes


def test_the_band_is_the_twins_running_maximum_above_its_floor():
    twin = {1: 1e-7, 2: 5e-8, 4: 3e-7}
    assert band(twin, {1: 2e-7, 2: 0, 3: 0, 4: 0}, [1, 2, 3, 4]) == {1: 2e-7, 2: 1e-7, 3: 1e-7, 4: 3e-7}
    # a twin that happens to agree exactly (0) still leaves a few units in the last place
    floor = floor_of({1: 2.0}, "float32")
    assert band({1: 0.0}, floor, [1]) == {1: 4 * 2.0 * 2.0 ** -23}
    assert floor_of({1: -2.0}, "bfloat16")[1] == 4 * 2.0 * 2.0 ** -7


def test_a_candidate_within_its_band_is_equivalent_and_says_its_largest_ratio():
    steps = range(1, 21)
    v = compare(*runs(steps, cand_scale=3.0), ORDER)
    assert v.equivalent and v.first is None and v.loss_departs is None
    assert math.isclose(v.largest.ratio, 3.0 / 8) and v.compared == 20 * len(ORDER)
    assert v.text().startswith("equivalent (largest observed/bound 0.38 at step ")  # every ratio 3/8 here


def test_a_departure_is_named_at_its_step_and_first_tensor_and_the_loss_later():
    # a gradient of 2.weight summed instead of averaged from step 7: its distance jumps 1000x there; the
    # parameters follow from step 8, the loss from step 9 (it departs later than the tensor that caused it)
    steps = range(1, 21)
    cand, twin, sizes = runs(steps)
    for q, at in (("grad:2.weight", 7), ("param:2.weight", 8), ("param:0.weight", 8), ("loss", 9)):
        cand[q] = {t: d * (1000 if t >= at else 1) for t, d in cand[q].items()}
    v = compare(cand, twin, sizes, ORDER)
    assert not v.equivalent
    assert (v.first.quantity, v.first.step) == ("grad:2.weight", 7) and math.isclose(v.first.ratio, 1000 / 8)
    assert v.loss_departs == 9
    assert v.text().startswith("departs at step 7: first grad:2.weight at observed/bound 125")
    assert "the loss departs at step 9" in v.text()
    # the clean twin of this fault: the same runs without it
    assert compare(*runs(steps), ORDER).equivalent


def test_two_tensors_departing_at_one_step_are_named_in_the_models_order_and_what_one_run_lacks_is_said():
    steps = range(1, 6)
    cand, twin, sizes = runs(steps)
    for q in ("param:0.weight", "grad:2.weight"):
        cand[q] = {t: d * (100 if t >= 3 else 1) for t, d in cand[q].items()}
    cand["grad:extra"] = {t: 1.0 for t in steps}  # a tensor only the candidate has
    v = compare(cand, twin, sizes, ORDER)
    assert (v.first.quantity, v.first.step) == ("grad:2.weight", 3)  # gradients before parameters
    assert v.missing == ["grad:extra"]


def test_gradients_all_scaled_by_one_factor_are_told_from_a_mixed_difference():
    ref = {"0.weight": 2.0, "0.bias": 0.5, "2.weight": 1.0}
    assert gradient_scale(ref, {k: v * 4 for k, v in ref.items()}) == 4.0  # summed over 4 ranks, not averaged
    assert gradient_scale(ref, {k: v / 2 for k, v in ref.items()}) == 0.5
    assert gradient_scale(ref, {k: v * 1.01 for k, v in ref.items()}) is None  # rounding: no factor
    assert gradient_scale(ref, {"0.weight": 8.0, "0.bias": 0.5, "2.weight": 1.0}) is None  # one tensor only


def test_a_nan_candidate_departs_an_exact_agreement_is_no_departure_and_the_band_stops_at_the_twin():
    steps = range(1, 6)
    cand, twin, sizes = runs(steps)
    cand["loss"] = {**cand["loss"], 4: math.nan, 5: math.inf}  # the candidate's loss went NaN, then Inf
    v = compare(cand, twin, sizes, ORDER)
    assert not v.equivalent and (v.first.quantity, v.first.step) == ("loss", 4) and v.first.ratio == math.inf
    # a quantity exactly 0 in every run (a LoRA factor's gradient at step 1, an unused parameter): ratio 0
    zero = {q: {t: 0.0 for t in steps} for q in ORDER}
    assert compare(zero, zero, {q: {t: 0.0 for t in steps} for q in ORDER}, ORDER).equivalent
    # past the twin's last step nothing is compared (its band says nothing of how rounding grows after it)
    short_twin = {q: {t: v for t, v in s.items() if t <= 3} for q, s in twin.items()}
    grown = {q: {t: v * (1000 if t > 3 else 1) for t, v in s.items()} for q, s in cand.items() if q != "loss"}
    v = compare(grown, short_twin, sizes, ORDER)
    assert v.equivalent and v.compared == 3 * (len(ORDER) - 1)
    # nothing compared is not "equivalent"
    assert not compare({}, {}, {}, ORDER).equivalent


def test_the_runs_checks_refuse_what_cannot_be_compared(tmp_path):
    import pytest

    from distdebug.analysis.parity import CannotCompare, Recorded, compare_runs

    def run(twin=False, steps=range(1, 6), loss=1.0, names=("w",)):
        sk = {t: {f"{k}:{n}": [0.1 * t, 0.2] for n in names for k in ("grad", "param")} for t in steps}
        return Recorded(world=1, twin=twin, seed=0, names=list(names), dtypes={n: "torch.float32" for n in names},
                        loss={t: loss for t in steps}, global_grad_norm={t: 1.0 for t in steps}, sketches=sk,
                        norms={t: {q: 1.0 for q in s} for t, s in sk.items()})

    assert compare_runs(run(), run(twin=True), run()).verdict.equivalent  # identical: equivalent
    for ref, twin, cand, why in ((run(), run(twin=True), run(steps=range(1, 3)), "the candidate's steps end at 2"),
                                 (run(loss=math.nan), run(twin=True), run(), "the reference's loss is not finite"),
                                 (run(), run(twin=True), run(names=("other",)), "share no parameter name"),
                                 (run(), run(), run(), "the twin must be"), (run(), run(twin=True), run(twin=True),
                                                                             "differ on purpose")):
        with pytest.raises(CannotCompare, match=why):
            compare_runs(ref, twin, cand)
    # a gradient scale where most of the candidate's norms are 0 (ZeRO's gradients gone at the boundary): no factor
    assert gradient_scale({"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 0.0, "b": 0.0, "c": 3.0}) is None

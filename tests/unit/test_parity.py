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


def test_a_gradient_that_cancels_at_one_step_is_judged_at_the_scale_of_its_terms():
    """A bias's gradient over a balanced batch is small at step 1 (0.0026 against 0.5 later): the sum's rounding is
    of its terms' size. The candidate's 7e-9 there (30 units in the last place of 0.0026, a fraction of one of 0.5),
    with a twin that happened to land exactly on the reference: within the band. A real change still departs."""
    from distdebug.analysis.parity import compare_runs

    def runs(at_step1):
        ref, twin, cand = made(), made(twin=True, noise=1e-7), made(world=2, noise=2e-7)
        for run in (ref, twin, cand):
            for t in run.norms:
                run.norms[t]["grad:2.weight"] = 0.0026 if t == 1 else 0.5
        twin.sketches[1]["grad:2.weight"] = list(ref.sketches[1]["grad:2.weight"])  # the twin: exactly 0 there
        cand.sketches[1]["grad:2.weight"] = [ref.sketches[1]["grad:2.weight"][0] + at_step1,
                                             ref.sketches[1]["grad:2.weight"][1]]
        return compare_runs(ref, twin, cand)

    assert runs(2e-8).verdict.equivalent
    # the scale: the largest finite norm so far, and over the first 8 recorded steps at the start (a gradient that
    # grows later does not loosen its early floor; an infinite norm, a skipped step's, loosens nothing)
    from distdebug.analysis.parity import _scale_of_terms

    norms = {1: 0.0026, 2: 0.5, 3: math.inf, **{t: 0.1 for t in range(4, 9)}, 16: 50.0, 32: 1.0}
    assert _scale_of_terms(norms) == {**{t: 0.5 for t in range(1, 9)}, 16: 50.0, 32: 50.0}
    bad = runs(1e-4).verdict
    assert (bad.first.step, bad.first.quantity) == (1, "grad:2.weight")


def test_a_gradient_zero_but_for_rounding_is_judged_at_its_modules_scale():
    """A convolution's bias before BatchNorm (a key projection's bias under softmax): its gradient cancels exactly,
    at every step, leaving rounding of its terms' size (1e-7, against its module's weight gradient of 1.0), which
    another order of sums draws anew. A candidate whose BatchNorm sums in another order lands 1e-7 from the
    reference there, 10 times the twin's distance: within the band of its module's scale, where its own norm would
    call it a departure. A real change of that gradient still departs at its step, named."""
    from distdebug.analysis.parity import _module_scale, compare_runs

    def with_bias(run, value, off_from=None):
        run.names.insert(1, "0.bias")
        run.dtypes["0.bias"] = "torch.float32"
        for t in run.sketches:
            off = 1e-2 if off_from is not None and t >= off_from else 0.0
            run.sketches[t]["grad:0.bias"] = [value + off, 0.0]
            run.sketches[t]["param:0.bias"] = [0.1, 0.0]
            run.norms[t].update({"grad:0.bias": 1e-7, "param:0.bias": 0.1})
        return run

    def verdict(cand_bias, off_from=None):
        ref, twin = with_bias(made(), 1e-7), with_bias(made(twin=True, noise=1e-7), 1.1e-7)
        return compare_runs(ref, twin, with_bias(made(world=2, noise=2e-7), cand_bias, off_from)).verdict

    clean = verdict(2e-7)
    assert clean.equivalent, clean.text()
    bad = verdict(2e-7, off_from=4)
    assert (bad.first.step, bad.first.quantity) == (4, "grad:0.bias"), bad.text()
    # the scale: each gradient's raised to its module's largest, step by step; a module of one gradient keeps its own
    scales = {"grad:a.weight": {1: 1.0, 2: 2.0}, "grad:a.bias": {1: 1e-7, 2: 1e-7}, "grad:b.bias": {1: 1e-7},
              "grad:a.b.weight": {1: 5.0}, "grad:weight": {1: 3.0}, "grad:bias": {1: 1e-7}}
    assert _module_scale(scales) == {"grad:a.weight": {1: 1.0, 2: 2.0}, "grad:a.bias": {1: 1.0, 2: 2.0},
                                     "grad:b.bias": {1: 1e-7}, "grad:a.b.weight": {1: 5.0},
                                     "grad:weight": {1: 3.0}, "grad:bias": {1: 3.0}}  # the root module's two


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


# ------------------------------------------------------------------------------------------------ the cause catalogue
NAMES = ["0.weight", "2.weight"]


def made(world=1, twin=False, noise=0.0, depart=(), steps=range(1, 9), **fields):
    """A run as ``recorded`` reads it: every quantity the reference's plus ``noise`` (the twin's rounding), and 1e-2
    more for each (quantity, from step) of ``depart``; ``fields``: the rest of Recorded (hyper, rows...)."""
    from distdebug.analysis.parity import Recorded

    def off(q, t):
        return noise + sum(1e-2 for dq, at in depart if dq == q and t >= at)

    qs = [f"{k}:{n}" for k in ("grad", "param") for n in NAMES] + [f"buffer:{b}" for b in fields.get("buffers", [])]
    sk = {t: {q: [0.5 + off(q, t), 0.25] for q in qs} for t in steps}
    return Recorded(world=world, twin=twin, seed=0, names=list(NAMES), dtypes={n: "torch.float32" for n in NAMES},
                    loss={t: 1.0 + off("loss", t) for t in steps}, global_grad_norm={t: 1.0 for t in steps},
                    sketches=sk, norms={t: {q: 1.0 for q in s} for t, s in sk.items()}, **fields)


def kinds(ref, cand):
    from distdebug.analysis.parity import compare_runs

    twin = made(twin=True, noise=1e-7, **{k: getattr(ref, k) for k in ("buffers", "hyper", "data", "rows")})
    p = compare_runs(ref, twin, cand)
    return p, [(c.kind, c.step) for c in p.causes]


def test_each_cause_class_is_named_from_its_evidence_and_its_clean_twin_names_none():
    hyper = {t: [{"lr": 0.1, "momentum": 0.9}] for t in range(1, 9)}
    # clean: the candidate as near the reference as the twin: equivalent, no cause
    p, found = kinds(made(hyper=hyper), made(world=2, noise=2e-7, hyper=hyper))
    assert p.verdict.equivalent and found == [] and p.cause is None
    # the learning rate x2 from step 3 (the world-size ratio): the parameters depart there, the gradients do not
    scaled = {t: [{"lr": 0.2 if t >= 3 else 0.1, "momentum": 0.9}] for t in range(1, 9)}
    p, found = kinds(made(hyper=hyper), made(world=2, hyper=scaled, depart=[("param:0.weight", 3),
                                                                             ("param:2.weight", 3)]))
    assert (p.verdict.first.step, p.verdict.first.quantity, found) == (3, "param:0.weight", [("hyperparameter", 3)])
    assert p.cause == ("the optimizer's lr 0.2 in the candidate, 0.1 in the reference, x2 (the world-size ratio) "
                       "at step 3")
    # the same departure with the same hyperparameters: the update is what differs
    p, found = kinds(made(hyper=hyper), made(world=2, hyper=hyper, depart=[("param:0.weight", 3)]))
    assert found == [("update", 3)]
    # the optimizer state in bfloat16 from step 4 (its dtypes recorded at each step)
    state = {t: {"0.weight": {"momentum_buffer": "float32"}} for t in range(1, 9)}
    low = {t: {"0.weight": {"momentum_buffer": "bfloat16" if t >= 4 else "float32"}} for t in range(1, 9)}
    p, found = kinds(made(state_dtypes=state), made(world=2, state_dtypes=low, depart=[("param:0.weight", 4)]))
    assert found == [("dtype", 4)] and "keeps momentum_buffer of 0.weight in bfloat16" in p.cause
    # the data: other samples at step 1 (as many), or another count
    data, rows = {t: [0.5, -0.25] for t in range(1, 9)}, {t: 8 for t in range(1, 9)}
    other = {**data, 1: [0.75, -0.25]}
    p, found = kinds(made(data=data, rows=rows), made(world=2, data=other, rows=rows,
                                                      depart=[("grad:0.weight", 1), ("loss", 1)]))
    assert found == [("data", 1)] and "other samples than the reference at step 1 (8 of them" in p.cause
    p, found = kinds(made(data=data, rows=rows), made(world=2, data=other, rows={**rows, 1: 16},
                                                      depart=[("grad:0.weight", 1)]))
    assert "saw 16 samples at step 1, the reference 8" in p.cause
    # a gradient the candidate's ranks disagree on, from step 5 (the others agree)
    per = {t: {0: {"0.weight": 1.0, "2.weight": 2.0}, 1: {"0.weight": 1.0, "2.weight": 2.0 if t < 5 else 2.5}}
           for t in range(1, 9)}
    p, found = kinds(made(), made(world=2, rank_grads=per, depart=[("grad:2.weight", 5)]))
    assert (p.verdict.first.quantity, found) == ("grad:2.weight", [("unreduced", 5)])
    assert "rank 0: 2, rank 1: 2.5" in p.cause
    # the norms alone: a clipping by each rank's own norm scales all of rank 1's gradients by 0.98; the one never
    # averaged is the gradient that leaves that common factor, not the one whose norms differ most
    from distdebug.analysis.parity import _apart

    norms = {0: {"a": 1.0, "b": 2.0, "c": 0.5, "d": 3.0}, 1: {"a": 0.98, "b": 1.96, "c": 0.49, "d": 3.0}}
    assert _apart(norms, ["a", "b", "c", "d"], clipped_apart=True) == ["d"]
    # with no clipping to explain a common factor, every gradient the ranks disagree on is apart (one factor on
    # all of them: each rank divided by its own count)
    assert set(_apart(norms, ["a", "b", "c", "d"])) == {"a", "b", "c"}
    assert _apart({0: {"a": 1.0, "b": 2.0}, 1: {"a": 1.0, "b": 2.0}}, ["a", "b"]) == []
    # a gradient 0 on the first rank and not on another (a row only rank 1's batch reached): the furthest apart
    assert _apart({0: {"a": 0.0, "b": 2.0}, 1: {"a": 0.3, "b": 2.1}}, ["a", "b"]) == ["a", "b"]
    # clip_grad_norm_ computing each rank's own norm from step 3 (before, and in the clean twin, one global norm on
    # every rank, however many calls): clipping; a departure elsewhere while the ranks clip alike does not name it
    same = {t: {0: [1.5, 0.5], 1: [1.5, 0.5]} for t in range(1, 9)}
    local = {t: {0: [1.5, 0.5], 1: [1.5, 0.5] if t < 3 else [1.9, 0.5]} for t in range(1, 9)}
    p, found = kinds(made(), made(world=2, clips=local, depart=[("grad:0.weight", 3)]))
    assert found == [("clipping", 3)] and "(rank 0: 1.5, rank 1: 1.9): each rank clipped by its own" in p.cause
    p, found = kinds(made(), made(world=2, clips=same, depart=[("param:0.weight", 3)]))
    assert found == [("update", 3)]
    p, found = kinds(made(), made(world=2, clips=same, noise=2e-7))
    assert p.verdict.equivalent and found == []
    # BatchNorm's running statistics depart at step 1 (with the gradients they feed)
    p, found = kinds(made(buffers=["1.running_mean"]), made(world=2, buffers=["1.running_mean"], depart=[
        ("grad:0.weight", 1), ("buffer:1.running_mean", 1), ("loss", 1)]))
    assert found == [("batchnorm", 1)] and p.cause.startswith("BatchNorm's 1.running_mean departs at step 1")
    # the loss departs at step 6 with the same parameters before it and the same data: the forward
    p, found = kinds(made(data=data, rows=rows), made(world=2, data=data, rows=rows,
                                                      depart=[("grad:0.weight", 6), ("loss", 6)]))
    assert found == [("forward", 6)] and "and the data agrees" in p.cause


def test_every_gradient_scaled_by_the_world_size_is_named_first_as_the_scale():
    from distdebug.analysis.parity import compare_runs

    ref, twin = made(), made(twin=True, noise=1e-7)
    cand = made(world=4, depart=[("grad:0.weight", 2), ("grad:2.weight", 2)])
    for t in range(2, 9):
        cand.norms[t] = {q: (4.0 if q.startswith("grad:") else 1.0) for q in cand.norms[t]}
    p = compare_runs(ref, twin, cand)
    assert [(c.kind, c.step) for c in p.causes] == [("gradient_scale", 2)] and "4x the reference's" in p.cause


def test_the_recorded_steps_are_chosen_and_a_bad_choice_is_one_line():
    import pytest
    from click.testing import CliRunner

    from distdebug.cli import main
    from distdebug.config import ParityConfig, chosen_steps
    from distdebug.errors import UserError

    assert chosen_steps("1-3, 10,pow2") == ({1, 2, 3, 10}, True) and chosen_steps("pow2") == (set(), True)
    assert chosen_steps(ParityConfig().steps) == (set(range(1, 9)), True)  # the default: 1-8 and powers of two
    for bad in ("0", "3-1", "x", "", "1-", ","):
        with pytest.raises(UserError, match="--parity-steps"):
            chosen_steps(bad)
    r = CliRunner().invoke(main, ["attach", "--parity", "record", "--parity-steps", "2-1", "train.py"])
    assert r.exit_code == 2 and "'2-1' is not a step (1 or more), a range A-B or pow2" in r.output, r.output
    r = CliRunner().invoke(main, ["attach", "--parity-steps", "1-4", "train.py"])
    assert r.exit_code == 2 and "give --parity record or twin" in r.output, r.output


def test_a_tensor_not_finite_in_the_reference_is_not_compared_and_data_split_otherwise_is_not_named():
    import math as m

    from distdebug.analysis.parity import compare_runs

    # a causal mask of -inf (a buffer): its sketch is not finite in every run; not compared, not a departure
    ref, twin, cand = (made(buffers=["mask"], twin=t, noise=n, world=w)
                       for t, n, w in ((False, 0.0, 1), (True, 1e-7, 1), (False, 2e-7, 2)))
    for run in (ref, twin, cand):
        for t in run.sketches:
            run.sketches[t]["buffer:mask"] = [m.nan, -m.inf]
    p = compare_runs(ref, twin, cand)
    assert p.verdict.equivalent and "buffer:mask" not in p.verdict.departed
    # inputs split along another dimension than the first (sequence-first) or padded per rank: other widths, so
    # the data's numbers are not compared and the loss's departure is not blamed on the data split
    data, rows = {t: [0.5, -0.25] for t in range(1, 9)}, {t: 8 for t in range(1, 9)}
    ref = made(data=data, rows=rows, widths={t: [8] for t in range(1, 9)})
    cand = made(world=2, data={**data, 1: [0.75, 0.0]}, rows={**rows, 1: 16}, widths={t: [4] for t in range(1, 9)},
                depart=[("grad:0.weight", 1), ("loss", 1)])
    p, found = kinds(ref, cand)
    assert [k for k, _ in found] == ["forward"]


def test_the_datas_fingerprint_is_the_same_however_the_samples_are_split_ordered_or_zero_padded():
    import torch

    from distdebug.detectors.parity import ParityRecorder

    def fingerprint(*batches, **kw):
        rec = ParityRecorder()
        module = torch.nn.Linear(1, 1).train()
        for b in batches:
            rec._fingerprint(module, (b,), {}) if not kw else rec._fingerprint(module, (), {"input_ids": b})
        return rec._data, rec._rows, rec._widths

    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    whole, rows, widths = fingerprint(x)
    assert rows == 8 and widths == {6} and whole.dtype == torch.float64 and whole.shape == (8,)
    for parts in ((x[:4], x[4:]), (x[4:], x[:4]), (x[::2], x[1::2])):  # two ranks, micro-batches, interleaved
        got, n, _ = fingerprint(*parts)
        assert n == 8 and torch.allclose(got, whole, rtol=0, atol=1e-12)
    padded, _, w = fingerprint(torch.cat([x, torch.zeros(8, 3)], dim=1))  # padded to a longer length with zeros
    assert w == {9} and torch.allclose(padded, whole, rtol=0, atol=1e-12)
    dup, n, _ = fingerprint(x[:4], x[:4])  # two ranks handed the same samples: as many, other ones
    assert n == 8 and (dup - whole).abs().max() > 1e-3
    by_name, _, _ = fingerprint(x, kw=True)  # model(**batch): the keyword arguments are read
    assert torch.equal(by_name, whole)
    with torch.no_grad():  # an evaluation forward (no gradients, or the module in eval) is not the step's data
        assert fingerprint(x)[1] == 0
    rec = ParityRecorder()
    rec._fingerprint(torch.nn.Linear(1, 1).eval(), (x,), {})
    assert rec._data is None and rec._rows == 0


def test_the_html_page_draws_both_losses_and_the_distance_against_its_bound(tmp_path):
    import math as m

    from distdebug.analysis.parity import compare_runs
    from distdebug.report.parity_html import MAX_POINTS, binned, render_parity_html

    hyper = {t: [{"lr": 0.1}] for t in range(1, 9)}
    scaled = {t: [{"lr": 0.2 if t >= 3 else 0.1}] for t in range(1, 9)}
    p = compare_runs(made(hyper=hyper), made(twin=True, noise=1e-7, hyper=hyper),
                     made(world=2, hyper=scaled, depart=[("param:0.weight", 3), ("loss", 4)]))
    assert set(p.series) == {"ref", "cand", "distance", "bound"} and p.series["distance"][4] > p.series["bound"][4]
    page = render_parity_html(p, tmp_path / "sub" / "parity.html", ref="REF<x>", cand="CAND", twin="TWIN")
    text = page.read_text()
    assert text.count("<svg") == 2 and text.count("<polyline") == 4  # both losses; distance and bound
    assert "departs</span>" in text and "departs: param:0.weight" in text and "the loss departs" in text
    assert "<b>hyperparameter</b> (step 3)" in text and "REF&lt;x&gt;" in text  # the causes; paths escaped
    clean = compare_runs(made(), made(twin=True, noise=1e-7), made(world=2, noise=2e-7))
    assert "equivalent</span>" in render_parity_html(clean, tmp_path / "ok.html").read_text()
    # a long run is binned to MAX_POINTS, keeping each bin's largest distance and any value that is not finite
    long = {t: 1e-9 for t in range(1, 10_001)}
    long[5000], long[7001] = 1.0, m.nan
    pts = binned(long, "max")
    assert len(pts) <= MAX_POINTS and (5000, 1.0) in pts and any(m.isnan(v) for _, v in pts)
    # on the log scale a zero distance (bit for bit) is a circle on the axis and breaks the line, never a point at
    # the smallest value drawn; every distance zero is said in words
    from distdebug.report.parity_html import svg

    drawn = svg([("d", "#000", [(1, 0.0), (2, 1e-6), (3, 2e-6), (4, 0.0), (5, 1e-3)], False)], log=True)
    assert drawn.count("<polyline") == 1 and drawn.count("r='3'") == 2 and "0 at step 4 (bit for bit)" in drawn
    assert drawn.count("r='1.5'") == 1  # step 5 alone between a zero and the end: a dot
    assert "agree bit for bit" in svg([("d", "#000", [(1, 0.0), (2, 0.0)], False)], log=True)
    drawn = svg([("d", "#000", [(1, 0.0), (2, m.nan)], False)], log=True)  # zeros and a NaN: both still shown
    assert "0 at step 1 (bit for bit)" in drawn and "nan at step 2" in drawn


def test_under_autocast_the_twin_flips_the_last_bit_of_the_compute_dtype_and_a_mixed_pair_names_it():
    import torch

    from distdebug.detectors.parity import ParityRecorder

    for autocast, bit in ((None, 0), ("bfloat16", 16), ("float16", 13)):
        rec = ParityRecorder()
        rec._autocast = autocast
        p = torch.nn.Parameter(torch.randn(4096))
        before = p.detach().clone()
        rec._perturb(3, [("w", p)])
        flipped = (p.detach().view(torch.int32) ^ before.view(torch.int32)).unique().tolist()
        assert flipped == [0, 1 << bit], (autocast, flipped)  # a random half, exactly that bit
        g = torch.randn(4096)  # and each backward's gradient, as a sum in that dtype rounds it (fp32: untouched)
        rounded = rec._round_grad(0, g)
        if autocast is None:
            assert rounded is None
        else:
            assert (rounded.view(torch.int32) ^ g.view(torch.int32)).unique().tolist() == [0, 1 << bit]
    module = torch.nn.Linear(2, 2)
    rec = ParityRecorder()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rec._seen_autocast(module)
    assert rec._autocast == "bfloat16"
    rec._seen_autocast(module)
    assert rec._autocast is None
    p, found = kinds(made(), made(world=2, autocast="bfloat16", depart=[("grad:0.weight", 1)]))
    assert found == [("dtype", 1)] and p.cause.startswith("the candidate's forward computes in bfloat16 (autocast)")


def test_the_norm_a_script_clips_by_is_kept_whichever_way_torch_clips():
    """clip_grad_norm_ (under both of its names), and torchtitan's two calls, get_total_norm then
    clip_grads_with_norm_: each call's norm kept once (clip_grad_norm_ calls the second under its private name), in
    the order of the calls, no read; the functions are torch's again when the session restores them."""
    import torch
    from torch.nn import utils as nn_utils

    from distdebug.context import RankContext, RankIdentity
    from distdebug.detectors.parity import ParityRecorder

    saved: list = []

    def patch(obj, name, replacement):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, replacement)

    originals = (nn_utils.clip_grad_norm_, nn_utils.clip_grads_with_norm_)
    rec = ParityRecorder()
    rec.ctx = RankContext(identity=RankIdentity.from_env(), run_dir=None, rank_dir=None, patch=patch)
    try:
        rec._watch_clipping(rec.ctx)
        params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))]
        for p, g in zip(params, (3.0, 4.0), strict=True):
            p.grad = torch.full_like(p, g)
        nn_utils.clip_grad_norm_(params, 100.0)  # sqrt(3*9 + 4*16) = sqrt(91)
        torch.nn.utils.clip_grad.clip_grad_norm_(params, 100.0)
        total = nn_utils.get_total_norm([p.grad for p in params])
        nn_utils.clip_grads_with_norm_(params, 1.0, total)  # clips: the norm given is kept, not the one after
        nn_utils.clip_grads_with_norm_(params, max_norm=1.0, total_norm=total * 2)
        assert [round(float(c) ** 2, 3) for c in rec._clips] == [91.0, 91.0, 91.0, 364.0]
        assert float(torch.cat([p.grad for p in params]).norm()) < 1.0  # the clipping itself happened
    finally:
        for obj, name, original in reversed(saved):
            setattr(obj, name, original)
    assert (nn_utils.clip_grad_norm_, nn_utils.clip_grads_with_norm_) == originals


def test_the_twin_must_share_the_references_precision_and_the_steps_loss_is_the_sum_backward_ran_on():
    import pytest
    import torch

    from distdebug.analysis.parity import CannotCompare, compare_runs
    from distdebug.runtime.clock import StepClock

    with pytest.raises(CannotCompare, match="make the twin with the reference's autocast"):
        compare_runs(made(autocast="bfloat16"), made(twin=True), made(world=2, autocast="bfloat16"))
    import sys

    for keep in (True, False):  # kept only where the parity recorder asks for it (keep_raw): else no work at all
        clock = StepClock()
        clock.keep_raw = keep
        for micro in (torch.tensor(0.25), torch.tensor(0.5)):  # two micro-batches, each loss divided by 2
            clock.add_loss(micro, sys._getframe())  # a caller's frame (a framework imported by another test reads it)
        clock.explicit(torch.tensor(0.5))  # distdebug.step(loss) with the last micro-batch's loss
        assert float(clock.loss_sum) == 0.5  # the step's as given
        assert (float(clock.raw_sum) == 0.75) if keep else clock.raw_sum is None  # parity's sum kept
    clock = StepClock()
    clock.keep_raw = True
    clock.explicit(2.0)  # no backward ran: the loss given is the sum
    assert clock.raw_sum == 2.0

"""Tier 1 (pure): the robust spike rule on synthetic loss curves."""

from __future__ import annotations

import math
import random

from distdebug.context import StepEvent
from distdebug.detectors.loss_spike import MIN_HISTORY, CrossRank, LossSpike, spike


def curve(n, seed=0, noise=0.03):
    rng = random.Random(seed)
    return [2.3 * math.exp(-i / 15) + 0.2 + rng.gauss(0, noise) for i in range(n)]


def run(values, threshold=8.0):
    det = LossSpike()
    det.threshold = threshold
    found = []
    for step, v in enumerate(values, 1):
        found += [f.step for f in det.on_step(StepEvent(rank=0, step=step, loss=v, step_time_s=0.0,
                                                         backward_calls=1, collectives=0))]
    return found


def test_early_drop_and_noise_are_not_spikes_over_many_seeds():
    for seed in range(20):
        assert run(curve(200, seed)) == [], seed


def test_a_spike_is_found_in_its_step_and_does_not_become_the_new_normal():
    values = curve(80)
    values[40] *= 10
    values[60] *= 5
    assert run(values) == [41, 61]


def test_plateau_floor_and_short_history():
    flat = [1.0] * 30
    assert spike(flat, 1.02, 8.0)[0] is False  # 5% floor: a wiggle on a plateau is not a spike
    assert spike(flat, 2.0, 8.0)[0] is True
    assert spike([1.0] * (MIN_HISTORY - 1), 100.0, 8.0)[0] is False  # the window fills first


def departures(per_rank, threshold=8.0, window=50):
    """Feed CrossRank step by step with {rank: curve}; (step, rank) of each reported departure."""
    cross = CrossRank(threshold, window)
    steps = len(next(iter(per_rank.values())))
    return [(s + 1, r) for s in range(steps)
            for r, *_ in cross.feed(s + 1, {rank: c[s] for rank, c in per_rank.items()})]


def test_ranks_seeing_different_data_do_not_depart_over_many_seeds():
    for seed in range(20):
        for world in (2, 3, 8):
            per_rank = {r: curve(150, seed * 100 + r, noise=0.05) for r in range(world)}
            assert departures(per_rank) == [], (seed, world)


def test_one_rank_departing_is_named_once_at_its_first_step():
    per_rank = {r: curve(100, r) for r in range(5)}  # the median of all ranks holds with two departing
    per_rank[2] = [v * 3 if i >= 50 else v for i, v in enumerate(per_rank[2])]  # from step 51 on, for good
    per_rank[0][70] *= 6  # a single bad batch on rank 0 at step 71
    assert departures(per_rank) == [(51, 2), (71, 0)]
    # Two ranks: the median is their mean; the one above it is the one named.
    two = {0: curve(60, 0), 1: curve(60, 1)}
    two[1][40] *= 4
    assert departures(two) == [(41, 1)]


def test_missing_or_nonfinite_losses_are_not_judged():
    cross = CrossRank(8.0, 50)
    for s in range(1, 30):
        assert cross.feed(s, {0: 1.0, 1: 1.01, 2: 0.99}) == []
    assert cross.feed(30, {0: 1.0, 1: float("nan"), 2: 50.0}) == []
    assert cross.feed(31, {0: 1.0, 1: None, 2: 50.0}) == []
    assert [r for r, *_ in cross.feed(32, {0: 1.0, 1: 1.0, 2: 50.0})] == [2]


def test_every_rank_moving_together_is_not_one_rank_departing():
    per_rank = {r: curve(80, r) for r in range(3)}
    for r, factor in ((0, 40), (1, 90), (2, 20)):  # a learning-rate blow-up: all jump, unequally
        per_rank[r][50] *= factor
    assert departures(per_rank) == []


def test_a_loss_that_collapses_or_turns_negative_is_found_and_the_early_drop_is_not():
    for seed in range(20):  # the steep early drop, both ways now: still nothing
        assert run(curve(200, seed)) == [], seed
    values = curve(60, 3)
    values[40] = -values[39] * 39  # a sign bug: 39x the level, below zero
    assert run(values) == [41]
    values = curve(60, 4)
    values[40] = values[39] / 39  # a collapse to 1/39 of the level
    assert run(values) == [41]
    assert spike([1.0] * 12, 0.5, 8.0) == (False, 1.0, -10.0)  # one-sided unless asked: the gradient norm
    assert spike([1.0] * 12, 0.5, 8.0, both=True)[0]


def _feed(det, values, first_step=1):
    return [f.step for step, v in enumerate(values, first_step)
            for f in det.on_step(StepEvent(rank=0, step=step, loss=v, step_time_s=0.0, backward_calls=1,
                                           collectives=0))]


def test_a_new_training_phase_keeps_the_loss_history_or_starts_a_new_level():
    """The session retires a model-watching detector at a new training phase (runtime.session._new_phase):
    a fit that resumes goes on from the history before it, so a spike 3 steps into the new phase is found
    (a fresh history would need MIN_HISTORY steps first); a phase that starts elsewhere (a fresh model,
    the next fold) is a new level, not a spike."""
    values = curve(40, 5)
    old = LossSpike()
    assert _feed(old, values[:20]) == []
    resumed = LossSpike()
    old.handover(resumed)
    later = values[20:26]
    later[3] *= 30
    assert _feed(resumed, later, 21) == [24]
    assert len(resumed.history["loss"]) == 20 + 5  # the spike is not added
    assert _feed(LossSpike(), later, 21) == []  # without the handover: too little history to judge
    fresh = LossSpike()
    _feed(fresh, values[:20])
    nxt = LossSpike()
    fresh.handover(nxt)
    assert _feed(nxt, curve(30, 6), 21) == []  # back at the start of a curve: 10x the level, then falling
    assert len(nxt.history["loss"]) == 30  # the old level dropped at the new phase's first loss


def test_the_loss_scale_is_divided_out_only_of_a_norm_read_as_the_backward_left_it():
    """Read when a backward ended, a loss scaler's gradients are scaled: the step's scale is divided out. Read at
    the boundary (no backward seen), a scaler's step has already unscaled them: left as it is."""
    import torch

    det = LossSpike()
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 512.0)  # norm 1024
    det.params = [p]

    def step(n, after_backward):
        if after_backward:
            det.after_backward()
        norm = float(det.probe(n)["grad_norm"])
        det.on_step(StepEvent(rank=0, step=n, loss=1.0, step_time_s=0.0, backward_calls=1, collectives=0,
                              readout={"loss_spike": {"grad_norm": norm}}, loss_scale=1024.0))
        return det.history["grad_norm"][-1]

    assert step(1, after_backward=True) == 1.0
    assert step(2, after_backward=False) == 1024.0


def _judge(loss, grad_norm):
    """The detector over one rank's recorded curve: [(step, signal)] of its findings."""
    det = LossSpike()
    found = []
    for step, (value, norm) in enumerate(zip(loss, grad_norm, strict=True), 1):
        event = StepEvent(rank=0, step=step, loss=value, step_time_s=0.0, backward_calls=1, collectives=0,
                          readout={"loss_spike": {"grad_norm": norm}})
        found += [(f.step, f.subject) for f in det.on_step(event)]
    return found


def test_real_curves_of_two_scripts_over_twenty_seeds_clean_and_with_every_planted_spike_and_collapse():
    """Issue 38: recorded by bench/loss_traces.py from two real scripts (a residual CNN with BatchNorm and SGD
    momentum; a GPT with AdamW, warm-up, cosine schedule and accumulation 2), 20 seeds each, 60 steps: every
    clean curve gives no finding (their early bumps included: the ResNet's gradient norm doubles at step 11 of
    seed 7), and a loss x3 spike, a loss x0.3 collapse and a gradient-norm x10 spike planted at any step from
    MIN_HISTORY + 1 (11) are each found at their step."""
    import json
    from pathlib import Path

    traces = json.loads((Path(__file__).parents[1] / "data" / "loss_curves" / "traces.json").read_text())
    assert sorted(traces) == ["gpt", "resnet"] and all(len(seeds) == 20 for seeds in traces.values())
    for script, seeds in traces.items():
        for seed, curve in seeds.items():
            loss, norm = curve["loss"], curve["grad_norm"]
            assert _judge(loss, norm) == [], (script, seed)
            for step in range(MIN_HISTORY + 1, len(loss) + 1):
                for factor in (3.0, 0.3):
                    planted = list(loss)
                    planted[step - 1] *= factor
                    assert (step, "loss") in _judge(planted, norm), (script, seed, step, factor)
                planted = list(norm)
                planted[step - 1] *= 10
                assert (step, "grad_norm") in _judge(loss, planted), (script, seed, step)

"""Tier 1 (pure): the robust spike rule on synthetic loss curves."""

from __future__ import annotations

import math
import random

from distdebug.detectors.base import StepEvent
from distdebug.detectors.loss_spike import MIN_HISTORY, LossSpike, spike


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

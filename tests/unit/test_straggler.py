"""Tier 1 (pure): straggler scores from per-rank arrival times on synthetic rows."""

from __future__ import annotations

import random

from distdebug.detectors.straggler import MIN_STEPS, scores, verdicts


def rows(world, steps=20, slow=None, late=0.0, data_late=False, offset=None, seed=0):
    """[step, step_time, boundary_t, forward_t, backward_t, data_s] per rank: 10 ms steps, 4 ms forward."""
    rng = random.Random(seed)
    out = {r: [] for r in range(world)}
    t = 100.0
    for s in range(2, steps + 2):
        step = 0.010 + late
        for r in range(world):
            jitter = rng.uniform(0, 0.0003)
            extra = late if r == slow else 0.0
            data = 0.0002 + (extra if data_late else 0.0)
            fwd = t + data + (0.0 if data_late else extra) + jitter  # arrives after its data and its extra work
            bwd = fwd + 0.004
            shift = (offset or {}).get(r, 0.0)  # another node's clock
            out[r].append([s, step, t + step + shift, fwd + shift, bwd + shift, data])
        t += step
    return out


def test_no_straggler_in_noise_and_too_few_steps():
    for seed in range(10):
        table = scores(rows(4, seed=seed))
        assert verdicts(table) == [] and all(row["score"] > 0.9 for row in table.values())
    assert scores(rows(2, steps=MIN_STEPS - 1)) == {}


def test_a_rank_late_at_every_step_is_named_with_its_cause():
    table = scores(rows(3, slow=2, late=0.020))
    ((rank, cause, row),) = verdicts(table)
    assert (rank, cause) == (2, "compute")
    assert abs(row["lateness_s"] - 0.020) < 0.001 and row["score"] < 0.5 and table[0]["score"] > 0.9
    ((rank, cause, _),) = verdicts(scores(rows(3, slow=1, late=0.020, data_late=True)))
    assert (rank, cause) == (1, "data")


def test_clocks_of_other_nodes_are_aligned_by_the_step_boundaries():
    ((rank, cause, _),) = verdicts(scores(rows(4, slow=3, late=0.02, offset={2: 5.0, 3: -7.5})))
    assert (rank, cause) == (3, "compute")
    assert verdicts(scores(rows(4, offset={1: 12.0}))) == []

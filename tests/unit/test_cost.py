"""Tier 1 (pure, in-process): what the harness costs, measured by itself (issue 18).

The exclusive-time clock (a region's time less what regions inside it gave to other owners), the
timing of guarded hooks and patches (a patch's call of what it replaced is the training's time), the
A/B schedule (the same steps on every rank), and the verdicts: the A/B's interval on synthetic blocks
with a known cost, and the report's advice over budget.
"""

from __future__ import annotations

import random
import time

import torch

from distdebug.analysis import cost as cost_analysis
from distdebug.analysis import overhead as ab
from distdebug.detectors.base import Detector
from distdebug.runtime import cost
from distdebug.runtime.overhead import WARM, Blocks, block_index, harness_on


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_region_is_charged_its_own_time_less_what_inner_regions_gave_others():
    ledger = cost.Ledger()

    def inner():
        busy(0.02)

    def outer():
        busy(0.01)
        cost.timed(ledger, "det", inner)
        busy(0.01)

    cost.timed(ledger, cost.SESSION, outer)
    assert 0.018e9 <= ledger.ns["det"] < 0.03e9
    assert 0.018e9 <= ledger.ns[cost.SESSION] < 0.03e9  # 20 ms of its own, not 40


class Probe(Detector):
    name = "probe"


def test_hooks_and_patches_are_timed_without_the_trainings_own_time():
    det = Probe()
    hook = det.guarded(lambda *a: busy(0.005))
    for _ in range(3):
        hook(None, None)
    assert det.cost_calls == 3 and 0.014e9 <= det.cost_ns < 0.03e9

    class Ctx:
        def patch(self, obj, name, fn):
            setattr(obj, name, fn)

    class Lib:
        @staticmethod
        def work():
            busy(0.05)  # the training's time: not the detector's
            return 7

    det2 = Probe()

    def make(original):
        def wrapper():
            busy(0.005)
            return original()
        return wrapper

    det2.patch(Ctx(), Lib, "work", make)
    assert Lib.work() == 7
    assert det2.cost_calls == 1 and 0.004e9 <= det2.cost_ns < 0.02e9
    # Paused (--measure-overhead's off block): the hook does nothing and costs nothing
    Detector.paused = True
    try:
        hook(None, None)
        assert Lib.work() == 7
    finally:
        Detector.paused = False
    assert det.cost_calls == 3 and det2.cost_calls == 1


def test_startup_is_kept_apart_and_per_step_figures_count_from_the_end_of_step_1():
    ledger = cost.Ledger()
    det = Probe()
    ledger.add("probe", 500_000_000, 0)  # step 1: attach, first fingerprints
    ledger.end_step([det], 1)
    for step in range(2, 12):
        ledger.add("probe", 1_000_000, 0)
        ledger.reads += 1
        ledger.end_step([det], step)
    ledger.add("probe", 9_000_000_000, 0)  # after the last step (the drain at the end): no step's cost
    snap = ledger.snapshot()
    assert snap["steps"] == 10 and snap["training_thread_ms"]["probe"] == 10.0 and snap["host_reads"] == 10
    assert snap["startup_ms"]["probe"] == 500.0
    rank = cost_analysis.per_rank(snap, [{"step": s, "step_time_s": 0.010} for s in range(1, 12)])
    assert rank is not None
    assert (rank["per_step_ms"]["probe"], rank["fraction"], rank["host_reads_per_step"]) == (1.0, 0.1, 1.0)
    job = cost_analysis.summarize_cost({0: rank})
    assert job is not None and job["advice"].startswith("the harness takes 10.0% of rank 0's median step")
    assert "the costliest detector is probe (1.000 ms): leave it out with --detectors=-probe" in job["advice"]
    # the session costliest: the trade is still the costliest detector's, and the session is said as the floor
    both = {**rank, "per_step_ms": {"session": 0.6, "replica_divergence": 0.4}}
    advice = cost_analysis.summarize_cost({0: both})["advice"]
    assert "the costliest detector is replica_divergence (0.400 ms): fingerprint every N steps" in advice
    assert advice.endswith("the session's own part (0.600 ms: the step's read, the wrappers) stays")
    # an opt-in detector is turned down by its own option, not by --detectors=- (which takes default ones only)
    rerun = cost_analysis.summarize_cost({0: {**rank, "per_step_ms": {"rerun": 0.9, "session": 0.2}}})["advice"]
    assert "the costliest detector is rerun (0.900 ms): run without --rerun-on-anomaly" in rerun
    cheap = cost_analysis.per_rank({**snap, "training_thread_ms": {"probe": 2.0}}, [{"step": 2, "step_time_s": 0.01}])
    assert cost_analysis.summarize_cost({0: cheap})["advice"] is None  # 2% of the step: within budget


def test_the_ab_schedule_is_decided_by_the_step_number_alone():
    modes = [harness_on(s, 4) for s in range(1, 20)]
    assert modes[:WARM] == [True, True]
    assert modes[WARM:] == [True] * 4 + [False] * 4 + [True] * 4 + [False] * 4 + [True]
    assert [block_index(s, 4) for s in (1, 2, 3, 6, 7, 11)] == [-1, -1, 0, 0, 1, 2]
    assert all(harness_on(s, 0) for s in range(1, 50))
    blocks = Blocks(4)
    done = [blocks.step_done(s, 0.01 * s) for s in range(1, 12)]
    # steps 3-6 are block 0 (on), 7-10 block 1 (off): each block's record comes with its last step
    assert [d["block"] if d else None for d in done] == [None] * 5 + [0] + [None] * 3 + [1] + [None]
    assert done[5]["on"] and not done[9]["on"] and len(done[9]["step_times_s"]) == 4


def test_the_ab_interval_holds_a_known_cost_and_the_tail_is_not_hidden():
    rng = random.Random(1)
    blocks = []
    drift = 1.0
    for i in range(40):
        if i % 2 == 0:
            drift = 1 + 0.3 * rng.random()  # the machine changes speed between pairs, not within a pair
        on = i % 2 == 0
        times = [0.010 * drift * (1.10 if on else 1.0) * (1 + rng.gauss(0, 0.02)) for _ in range(8)]
        blocks.append({"block": i, "on": on, "step_times_s": times})
    o = ab.ab(blocks)
    assert o is not None and o["pairs"] == 20 and o["steps"] == 320
    assert o["ci"][0] < 0.10 < o["ci"][1] and o["ci"][1] - o["ci"][0] < 0.03
    assert abs(o["median_fraction"] - 0.10) < 0.02
    # a cost every 8th step (one step of each on block is 3x): the mean and the 95th percentile say it
    spiky = [{**b, "step_times_s": [t / (1.10 if b["on"] else 1.0) for t in b["step_times_s"]]} for b in blocks]
    for b in spiky:
        if b["on"]:
            b["step_times_s"][3] *= 3
    o = ab.ab(spiky)
    assert abs(o["median_fraction"]) < 0.02 and o["fraction"] > 0.15 and o["p95_fraction"] > 1.0
    assert "harness overhead +" in ab.describe({**o, "rank": 0})
    assert ab.ab([{"block": 0, "on": True, "step_times_s": [0.01]}]) is None  # no pair, no verdict


def test_a_paused_detector_reads_nothing_at_the_boundary():
    # The session skips a paused detector's probe: no device value is even made
    made = []

    class Reader(Detector):
        name = "reader"

        def probe(self, step):
            made.append(step)
            return {"x": torch.zeros(())}

    from distdebug.context import RankIdentity
    from distdebug.runtime.session import Session

    s = Session(RankIdentity(rank=0, local_rank=0, world_size=1, local_world_size=1, node=0, attempt=0, host="h",
                             pid=1), None, [Reader()], echo=False)
    s._read_step(False)
    Detector.paused = True
    try:
        s._read_step(True)
    finally:
        Detector.paused = False
    assert made == [0]

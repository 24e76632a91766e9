"""Tier 1 (pure, in-process): what the harness costs, measured by itself (issue 18).

The exclusive-time clock (a region's time less what regions inside it gave to other owners), the
timing of guarded hooks and patches (a patch's call of what it replaced is the training's time), the
A/B schedule (the same steps on every rank), and the verdicts: the A/B's interval on synthetic blocks
with a known cost, and the report's advice over budget.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from distdebug.analysis import cost as cost_analysis
from distdebug.analysis import overhead as ab
from distdebug.artifacts.digest import Digest
from distdebug.detectors.base import Detector
from distdebug.runtime import cost
from distdebug.runtime.overhead import WARM, Pairs, harness_on, on_first, unit_of


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
    rank = cost_analysis.per_rank(snap, 10.0)
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
    cheap = cost_analysis.per_rank({**snap, "training_thread_ms": {"probe": 2.0}}, 10.0)
    assert cost_analysis.summarize_cost({0: cheap})["advice"] is None  # 2% of the step: within budget


def test_the_ab_schedule_is_drawn_per_pair_from_the_step_number_alone():
    assert [harness_on(s, 1) for s in range(1, WARM + 1)] == [True, True]
    for unit in (1, 4):
        modes = [harness_on(s, unit) for s in range(WARM + 1, WARM + 1 + 2 * unit * 200)]
        units = [modes[i:i + unit] for i in range(0, len(modes), unit)]
        assert all(len(set(u)) == 1 for u in units)  # a unit is all on or all off
        pairs = [(units[i][0], units[i + 1][0]) for i in range(0, len(units), 2)]
        assert all(a != b for a, b in pairs)  # one unit on, one off, in every pair
        firsts = [a for a, _ in pairs]
        assert 80 < sum(firsts) < 120  # the order drawn, about half each way: no period can line up with it
        assert [on_first(k) for k in range(200)] == firsts  # the same on every rank: the pair's number alone
    assert all(harness_on(s, 0) for s in range(1, 50))
    assert [unit_of(s, 4) for s in (3, 6, 7, 11, 19)] == [(0, 0), (0, 0), (0, 1), (1, 0), (2, 0)]
    pairs = Pairs(1)
    done = [pairs.step_done(s, 0.01 * s * s, 0.002 * s) for s in range(1, 9)]
    # steps 3-4 are pair 0, 5-6 pair 1, 7-8 pair 2: each pair's record comes with its last step
    assert [d["block"] if d else None for d in done] == [None, None, None, 0, None, 1, None, 2]
    first = done[3]
    on_step = 3 if on_first(0) else 4
    assert first["on_first"] == on_first(0) and first["last_step"] == 4
    assert first["on_s"] == [round(0.01 * (on_step ** 2 - (on_step - 1) ** 2), 7)]
    assert first["on_cpu_s"] == [0.002] and first["off_cpu_s"] == [0.002]


def test_the_ab_interval_holds_a_known_cost_in_wall_and_cpu_time():
    rng = random.Random(1)
    pairs = []
    for k in range(300):
        machine = 1 + 0.3 * rng.random()  # the machine's speed changes between pairs, not within one
        wait = [rng.expovariate(1 / 0.004) for _ in range(2)]  # the other rank's pace: wall time only
        cpu = [0.010 * machine * (1 + rng.gauss(0, 0.01)) for _ in range(2)]
        on_cpu, off_cpu = cpu[0] + 0.0005, cpu[1]  # the harness: 0.5 ms of the training thread's CPU
        pairs.append({"block": k, "on_first": True, "on_s": [on_cpu + wait[0]], "off_s": [off_cpu + wait[1]],
                      "on_cpu_s": [on_cpu], "off_cpu_s": [off_cpu]})
    o = ab.ab(pairs)
    assert o is not None and o["pairs"] == 300 and o["steps"] == 600 and o["unit"] == 1
    assert o["cpu_ci"][0] < 0.5 / 11.5 < o["cpu_ci"][1] and o["cpu_ci"][1] - o["cpu_ci"][0] < 0.004
    assert abs(o["cpu_per_step_ms"] - 0.5) < 0.03
    assert o["ci"][0] < 0.5 / 15.5 < o["ci"][1]  # the wall time: the same cost, a wider interval
    assert o["ci"][1] - o["ci"][0] > o["cpu_ci"][1] - o["cpu_ci"][0]
    # a cost every 16th step (one on step in 8 is 3x): the mean and the 95th percentile say it
    spiky = [{**p, "on_s": [p["off_s"][0] * (3 if k % 8 == 0 else 1)]} for k, p in enumerate(pairs)]
    o = ab.ab(spiky)
    assert o["median_fraction"] < 0.1 and o["fraction"] > 0.2 and o["p95_fraction"] > 0.5
    text = ab.describe({**o, "rank": 0})
    assert "harness overhead +" in text and "of the wall time" in text and "the training thread's CPU time" in text
    assert ab.ab([{"block": 0, "on": True, "step_times_s": [0.01]}]) is None  # an older run's blocks: no verdict


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


def test_one_off_work_is_kept_apart_from_the_steady_cost():
    from distdebug.runtime.reexecution import REEXECUTION, Reexecution

    ledger = cost.Ledger()
    saved, cost.LEDGER = cost.LEDGER, ledger
    try:
        det = Probe()
        ledger.end_step([det], 1)

        def on_step_with_a_replay():
            busy(0.002)
            with Reexecution().replay(7):  # rerun's and nan_origin's re-execution of a flagged step
                busy(0.2)

        for step in range(2, 6):
            cost.timed(ledger, "rerun", on_step_with_a_replay if step == 4 else lambda: busy(0.002))
            ledger.end_step([det], step)
    finally:
        cost.LEDGER = saved
    snap = ledger.snapshot()
    # 4 x 2 ms a step: the 200 ms replay is not in it (bounds wide enough for a loaded machine's preemptions)
    assert 7.0 <= snap["training_thread_ms"]["rerun"] < 100.0
    (ms, times), = [snap["one_off_ms"][REEXECUTION]]
    assert ms >= 199.0 and times == 1
    digest = Digest()  # the figures the report reads: the rank's digest of its step records
    for r in [{"step": s, "step_time_s": 0.010} for s in range(1, 6)] + [{"step": 6, "step_time_s": 0.050}]:
        digest.feed({"kind": "step", **r})
    digest.feed({"kind": "trace", "steps": [6, 6]})
    rank = cost_analysis.per_rank(snap, digest.work_median_ms(), digest.traced, [{"steps": [6, 6]}])
    assert rank is not None and rank["one_off"] == [{"what": REEXECUTION, "ms": ms, "times": 1}]
    assert rank["profiler_windows"] == [{"steps": "6-6", "extra_ms": 40.0}]  # its step above the median
    steady = rank["total_per_step_ms"]
    # total_per_step_ms is itself rounded to 4 places: the same sum, up to that rounding
    assert rank["whole_run_per_step_ms"] == pytest.approx(steady + (ms + 40.0 + rank["startup_ms"]) / 4, abs=2e-4)
    from distdebug.report.fmt import one_off_text

    text = one_off_text(rank)
    assert f"re-execution of a step {ms:.0f} ms (1x)" in text and "profiler window steps 6-6 40 ms" in text


def test_a_one_off_inside_a_hook_is_not_the_hooks_steady_time():
    # a re-execution started from a finding listener runs inside a guarded hook (Detector.guarded)
    det = Probe()
    ledger = cost.Ledger()

    def listener(*_):
        busy(0.002)
        with cost.one_off("re-execution of a step", ledger):
            busy(0.2)

    det.guarded(listener)(None, None)
    assert 0.0015e9 <= det.cost_ns < 0.1e9  # its own 2 ms, not the 200 ms re-execution
    assert ledger.one_off_ns["re-execution of a step"] >= 0.199e9


def test_a_pair_with_a_step_jump_is_dropped_and_cuda_has_no_cpu_figure():
    pairs = Pairs(1)
    done = [pairs.step_done(s, float(s), 0.5 * s) for s in (1, 2, 3, 4, 5, 7, 8, 9, 10)]  # 6 never ended
    # pair 0 (3-4) whole; pair 1 (5-6) lost its second step: dropped, never merged with pair 2 (7-8), which
    # starts after the jump (its first step's time would run from step 5's end): dropped; pair 3 (9-10) whole
    assert [d["block"] for d in done if d] == [0, 3]
    cuda = Pairs(1)
    out = [cuda.step_done(s, float(s), None) for s in range(1, 5)][-1]
    assert out is not None and "on_cpu_s" not in out and len(out["on_s"]) == 1  # wall only
    from distdebug.runtime.overhead import default_unit

    assert (default_unit(False), default_unit(True)) == (4, 8)


def test_a_pair_with_one_off_work_is_left_out_of_the_comparison():
    # a profiler window's export or a re-execution in one step of a pair: hundreds of ms in one step, which
    # would widen the interval and move the mean; counted apart (one_off), left out of the steady A/B
    pairs = Pairs(1)
    done = [pairs.step_done(s, 0.1 * s + (0.8 if s == 5 else 0.0), None, once=s == 5) for s in range(1, 9)]
    records = [d for d in done if d]
    assert [r.get("one_off", False) for r in records] == [False, True, False]
    o = ab.ab(records)
    assert o is not None and (o["pairs"], o["left_out"]) == (2, 1)
    assert "1 pair with one-off work left out" in ab.describe({**o, "rank": 0})
    ledger = cost.Ledger()
    with cost.one_off("a window", ledger, count=False, opens=1):
        pass
    assert (ledger.one_off_regions, ledger.windows_open) == (1, 1)
    with cost.one_off("a window", ledger, opens=-1):
        pass
    assert (ledger.one_off_regions, ledger.windows_open, ledger.one_off_times["a window"]) == (2, 0, 1)


def test_an_off_step_pays_only_the_sessions_counting_and_the_report_adds_what_it_paid():
    # The A/B's off half must be the run without distdebug: a backward in it is counted and nothing more (no
    # end-of-backward pass queued, no loss kept, no detector told); what the off steps still paid the session is
    # measured apart and added to the A/B's difference (issue 62: the off half paid the session's gradient
    # norms and capture, so the report said less than a run without distdebug showed).
    from distdebug.context import RankIdentity
    from distdebug.runtime.session import Session

    after = []

    class After(Detector):
        name = "after"

        def after_backward(self):
            after.append(1)

    s = Session(RankIdentity(rank=0, local_rank=0, world_size=1, local_world_size=1, node=0, attempt=0, host="h",
                             pid=1), None, [After()], echo=False)
    s.dispatch.arrange()
    s.finder.discovering = False
    queued = []
    s.ctx.end_of_backward.append(lambda: queued.append(1))
    w = torch.ones(2, requires_grad=True)
    for paused in (True, False):
        Detector.paused = paused
        try:
            loss = (w * 2).sum()
            s.note_loss(loss)
            loss.backward()
            s.after_backward()
        finally:
            Detector.paused = False
    assert queued == [1] and after == [1]  # the on step only
    assert s.clock.backward_calls == 2 and s.clock.loss_n == 1  # both counted; the off step's loss not kept
    led = cost.Ledger()
    led.add(cost.SESSION, 3_000_000)
    led.step_mode(False)  # an on step: 3 ms of the session's
    led.add(cost.SESSION, 200_000)
    led.off_steps += 1
    led.step_mode(True)  # an off step: 0.2 ms
    assert led.off_session_ns == 200_000
    assert cost_analysis.off_paid_ms({"off_steps": 1, "off_session_ms": 0.2}) == 0.2
    assert cost_analysis.off_paid_ms({"off_steps": 0}) is None
    pairs = [{"block": k, "on_first": True, "on_s": [0.011], "off_s": [0.010], "on_cpu_s": [0.011],
              "off_cpu_s": [0.010]} for k in range(4)]
    o = ab.ab(pairs, 0.2)
    assert (o["cpu_per_step_ms"], o["off_paid_ms"], o["paid_ms"]) == (1.0, 0.2, 1.2)
    assert "against a run without distdebug 1.200 ms a step" in ab.describe({**o, "rank": 0})
    # the self-accounting's per-step figures count the on steps: the off steps' session time is not theirs
    c = cost_analysis.per_rank({"steps": 4, "off_steps": 2, "off_session_ms": 0.4,
                                "training_thread_ms": {"session": 6.4}}, 10.0)
    assert c is not None and c["per_step_ms"]["session"] == 3.0


def test_the_harness_threads_cpu_is_read_from_their_own_proc_lines_as_psutil_reads_it(monkeypatch):
    """cost.thread_cpu_s reads /proc/self/task/TID/stat for the distdebug-* threads only; psutil (every thread of
    the process) is its fallback: both give the same seconds, and a thread of another name is not counted."""
    import threading

    from distdebug.runtime import cost as runtime_cost

    spun = {name: threading.Event() for name in ("distdebug-spin", "not-ours")}
    done = threading.Event()

    def work(name: str) -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.2:  # CPU time of its own, then idle (alive) until told to end
            sum(range(1000))
        spun[name].set()
        done.wait(30)

    threads = [threading.Thread(target=work, args=(name,), name=name) for name in spun]
    for t in threads:
        t.start()
    try:
        assert all(e.wait(30) for e in spun.values())
        time.sleep(0.05)
        by_proc = runtime_cost.thread_cpu_s()
        monkeypatch.setattr(runtime_cost, "_PROC", False)
        by_psutil = runtime_cost.thread_cpu_s()
    finally:
        done.set()
        for t in threads:
            t.join()
    assert set(by_proc) == {"distdebug-spin"} and set(by_psutil) == {"distdebug-spin"}
    assert by_proc["distdebug-spin"] >= 0.15
    assert abs(by_proc["distdebug-spin"] - by_psutil["distdebug-spin"]) <= 2.0 / runtime_cost._TICKS


def test_the_ab_default_units_charge_what_an_on_step_leaves_to_the_next_to_the_harness():
    # A step with the harness leaves something to the step after it (caches and allocator disturbed, young objects
    # that bring the collector round): a run with distdebug pays it every step. Modelled here: a bare step of 1 ms,
    # the harness's own 0.5 ms, and 0.2 ms paid by any step that follows an on step; the user pays 0.7 ms a step.
    from distdebug.runtime.overhead import default_unit

    def measured(unit):
        pairs, records, cpu, before = Pairs(unit), [], 0.0, True
        for s in range(1, WARM + 1 + 2 * unit * 400):
            on = harness_on(s, unit)
            cpu += 1e-3 + (0.5e-3 if on else 0.0) + (0.2e-3 if before else 0.0)
            before = on
            if (done := pairs.step_done(s, cpu, cpu)) is not None:
                records.append(done)
        return ab.ab(records)["cpu_per_step_ms"]

    single, default = measured(1), measured(default_unit(False))
    assert abs(single - (0.5 - 0.1)) < 0.03  # single steps: low by one and a half times the carry-over
    assert abs(default - (0.7 - 0.3 / 4)) < 0.03 and default_unit(False) == 4  # units of 4: a quarter of that

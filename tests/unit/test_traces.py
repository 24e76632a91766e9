"""Tier 1 (pure): profiler window analysis on a hand-checked fixture trace, and the window grammar.

The fixture (tests/data/traces/steps-3-4/rank-00000.pt.trace.json), in microseconds:
step 3 is [0, 100): data loader [0, 10), operators of the training thread [10, 40) (with a nested
add) and [60, 80), a collective enqueue at 40 (not compute), gloo work [30, 70) on another thread;
step 4 is [100, 150): an operator [105, 145), gloo work [140, 160) (only [140, 150) inside the step).
An operator on a third thread is not the training thread's compute.
"""

from __future__ import annotations

import pytest

from distdebug.analysis.traces import analyze_run, analyze_window, intersect, merge
from distdebug.detectors.profiler import parse_windows
from tests.helpers import DATA

FIXTURE = DATA / "traces" / "steps-3-4"


def test_fixture_numbers_by_hand():
    w = analyze_window(FIXTURE)
    assert w["steps"] == [3, 4]
    r = w["ranks"][0]
    assert r["device"] == "cpu"
    assert [(s["step"], s["step_us"], s["compute_us"], s["comm_us"], s["overlap_us"], s["data_us"])
            for s in r["steps"]] == [(3, 100, 50, 40, 20, 10), (4, 50, 40, 10, 5, 0)]
    assert r["overlap_ratio"] == pytest.approx(25 / 50)
    assert r["comm_share"] == pytest.approx(50 / 150) and r["data_share"] == pytest.approx(10 / 150)
    assert r["compute_share"] == pytest.approx(90 / 150)
    # Top operators: every thread's operators, inclusive time (step marks and gloo work are not operators).
    assert [(o["name"], o["total_us"], o["count"]) for o in r["top_ops"]] == [
        ("aten::copy_", 90, 1), ("aten::mm", 70, 2), ("aten::relu", 20, 1), ("aten::add", 10, 1),
        ("c10d::allreduce_", 2, 1)]
    # 50% overlap is not healthy, but not under the blocking threshold either: no verdict.
    assert w["verdicts"] == []
    assert analyze_run(FIXTURE) == []  # a directory without traces/ has no windows
    assert [w["steps"] for w in analyze_run(DATA)] == [[3, 4]]


def test_interval_helpers():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert intersect([(0, 3), (5, 8)], [(2, 6)]) == [(2, 3), (5, 6)]


def test_window_grammar():
    assert parse_windows("4995:5005, 20:22") == [(20, 22), (4995, 5005)]
    assert parse_windows("7") == [(7, 7)] and parse_windows("") == []
    for bad, why in (("1:5", "2 <= A <= B"), ("9:3", "2 <= A <= B"), ("a:b", "is not A:B")):
        with pytest.raises(ValueError, match=why):
            parse_windows(bad)


def test_gpu_trace_uses_kernels_nccl_for_communication():
    """A GPU window (synthetic, by hand): compute kernels [60, 100) and [120, 140), an NCCL kernel
    [90, 150) in a 200 us step: 60 us of communication, 10 + 20 of it overlapped (50%), data loader
    [0, 50). The CPU-side nccl annotation is not communication time."""
    (w,) = analyze_run(DATA / "traces_gpu")
    r = w["ranks"][3]
    assert r["device"] == "gpu"
    assert [(s["step_us"], s["compute_us"], s["comm_us"], s["overlap_us"], s["data_us"]) for s in r["steps"]] == \
        [(200, 60, 60, 30, 50)]
    assert r["overlap_ratio"] == pytest.approx(0.5) and r["data_share"] == pytest.approx(0.25)
    assert w["verdicts"] == ["data loading takes 25% of the step: more DataLoader workers, pin_memory, prefetching"]
    assert r["top_ops"][0]["name"] == "ncclDevKernel_AllReduce_Sum_f32_RING_LL"

"""Tier 1 (pure): profiler window analysis on a hand-checked fixture trace, and the window grammar.

The fixture (tests/data/traces/steps-3-4/rank-00000.pt.trace.json), in microseconds:
step 3 is [0, 100): data loader [0, 10), operators of the training thread [10, 40) (with a nested
add) and [60, 80), a collective enqueue at 40 (not compute), gloo work [30, 70) on another thread;
step 4 is [100, 150): an operator [105, 145), gloo work [140, 160) (only [140, 150) inside the step).
An operator on a third thread is not the training thread's compute.

A window the job ends inside (tests/data/traces_job_end, described below) holds only its complete steps;
the profiler detector, run in this process with torch's real profiler, records them in the trace
however the window ends.
"""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from distdebug.analysis.traces import analyze_run, analyze_trace, analyze_window, intersect, merge
from distdebug.config import ProfilerConfig
from distdebug.context import RankContext, RankIdentity, StepEvent
from distdebug.detectors.profiler import Profiler, parse_windows
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


# ---------------------------------------------------------------- a window the job ends inside
JOB_END = DATA / "traces_job_end" / "traces" / "steps-5-6"
"""Both ranks' traces (by hand, microseconds): steps 5 [0, 100) and 6 [100, 200), each with the data
loader for 30, compute for 60 and gloo work for 40 inside the compute (100% overlap, data 30% of the
step: a verdict); then ``ProfilerStep#7`` [200, 1100), which torch's profiler opened at step 6's end
and closed at the job's end: a save (``aten::copy_``, 700) and a final all_reduce (200) the training
thread waits on. Rank 0's trace is as written before the window recorded its complete steps (the cut
comes from the directory's name); rank 1's carries ``distdebug_window`` {planned [5, 9], steps [5, 6]}."""


def test_a_window_the_job_ends_inside_holds_only_its_complete_steps():
    w = analyze_window(JOB_END)
    assert w["steps"] == [5, 6]
    for rank in (0, 1):
        r = w["ranks"][rank]
        assert [(s["step"], s["step_us"], s["compute_us"], s["comm_us"], s["overlap_us"], s["data_us"])
                for s in r["steps"]] == [(5, 100, 60, 40, 40, 30), (6, 100, 60, 40, 40, 30)]
        assert r["left_out"] == [{"mark": 7, "us": 900}]  # the job's end, not a step
        assert r["overlap_ratio"] == 1 and r["data_share"] == pytest.approx(0.3)
        assert r["comm_share"] == pytest.approx(0.4) and r["compute_share"] == pytest.approx(0.6)
        # The save after the loop is not the window's top operator: only the real steps' operators count.
        assert [(o["name"], o["total_us"], o["count"]) for o in r["top_ops"]] == [("aten::mm", 120, 2)]
    # The teardown's unoverlapped all_reduce made "communication blocks computation" (29%) and its
    # length hid the data loader's 30%: the verdicts are the real steps'.
    assert w["verdicts"] == ["data loading takes 30% of the step: more DataLoader workers, pin_memory, prefetching"]


def test_the_cut_is_exact_and_a_window_in_the_middle_is_unchanged():
    """Clean twin: the same steps without the mark after them (a window that ended at its planned
    length, in the middle of a run) give the same numbers, and nothing is left out."""
    trace = json.loads((JOB_END / "rank-00001.pt.trace.json").read_text())
    middle = {**trace, "distdebug_window": {"planned": [5, 6], "steps": [5, 6]},
              "traceEvents": [e for e in trace["traceEvents"] if e["ts"] < 200]}
    cut, whole = analyze_trace(trace), analyze_trace(middle)
    assert whole["left_out"] == [] and {**cut, "left_out": []} == whole
    # A trace of no window of ours (no record, no directory to name its steps): every mark is a step.
    assert [s["step"] for s in analyze_trace({"traceEvents": trace["traceEvents"]})["steps"]] == [5, 6, 7]


def test_a_window_without_a_complete_step_says_so_instead_of_a_verdict(tmp_path):
    """The job ended (returned or raised) inside the window's first step: its trace holds that
    unfinished step only; it is measured by nothing and judged by nothing."""
    trace = json.loads((JOB_END / "rank-00001.pt.trace.json").read_text())
    trace["distdebug_window"] = {"planned": [5, 9], "steps": []}
    trace["traceEvents"] = [dict(e, name="ProfilerStep#5") if e["name"] == "ProfilerStep#7" else e
                            for e in trace["traceEvents"] if e["ts"] >= 200]
    window = tmp_path / "traces" / "steps-5-5"
    window.mkdir(parents=True)
    (window / "rank-00001.pt.trace.json").write_text(json.dumps(trace))
    (w,) = analyze_run(tmp_path)
    r = w["ranks"][1]
    assert r["steps"] == [] and r["top_ops"] == [] and r["left_out"] == [{"mark": 5, "us": 900}]
    assert r["overlap_ratio"] is None and w["summary"]["overlap_ratio"] is None
    assert w["verdicts"] == ["no complete step: the job ended inside step 5, before the window's first step "
                             "finished (nothing measured)"]


def _event(step: int) -> StepEvent:
    return StepEvent(rank=0, step=step, loss=None, step_time_s=0.0, backward_calls=1, collectives=0)


def _train(n: int) -> None:
    a = torch.randn(64, 64)
    for _ in range(n):
        a = (a @ a).tanh()


@pytest.mark.parametrize("end", ["planned", "job", "exception", "first step"])
def test_the_profiler_records_a_windows_complete_steps_however_it_ends(tmp_path, end):
    """Tier 1 with torch's real profiler in this process: window 3:5 ends at its planned length
    (a run of 7 steps), with the job after step 4 (returned; or raised inside step 5), or with the
    job inside step 3. Work after the last step (a save, a final computation) is no step."""
    last = {"planned": 7, "job": 4, "exception": 4, "first step": 2}[end]
    ctx = RankContext(RankIdentity(rank=0, local_rank=0, world_size=1, local_world_size=1, node=0, attempt=0,
                                   host="h", pid=0), run_dir=tmp_path, rank_dir=None)
    det = Profiler(ProfilerConfig(steps="3:5", on_finding=0))
    det.attach(ctx)
    for step in range(1, last + 1):
        _train(2)
        list(det.on_step(_event(step)))
    try:  # after the loop: the teardown; or the next step, which raises (the session ends the same way)
        _train(20)
        if end == "exception":
            raise RuntimeError("the script's")
    except RuntimeError:
        pass
    finally:
        list(det.on_end())
    done = {"planned": [3, 5], "job": [3, 4], "exception": [3, 4], "first step": []}[end]
    (path,) = (tmp_path / "traces").glob("*/rank-00000.pt.trace.json.gz")
    assert path.parent.name == {"planned": "steps-3-5", "first step": "steps-3-3"}.get(end, "steps-3-4")
    trace = json.load(gzip.open(path, "rt"))
    assert trace["distdebug_window"] == {"planned": [3, 5], "steps": done}
    (w,) = analyze_run(tmp_path)
    r = w["ranks"][0]
    assert [s["step"] for s in r["steps"]] == (list(range(done[0], done[1] + 1)) if done else [])
    assert [m["mark"] for m in r["left_out"]] == ([] if end == "planned" else [last + 1])
    assert ("no complete step" in " ".join(w["verdicts"])) == (not done)

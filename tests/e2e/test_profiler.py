"""Tier 3 (CLI end to end): profiler windows on every rank, aligned by step, their analysis in the
report, a window triggered by a finding, and a bad window spec.

Needs: 2 ranks (windows aligned by step across ranks); 10 steps around the requested windows; 38 where
a finding triggers a window: the spike injected at step 20 (after loss_spike's warm-up) opens a window
at the first multiple of 8 at least 9 steps on (32-36), which must end inside the run."""

from __future__ import annotations

import gzip
import json
import re

from tests.e2e.test_attach import kinds
from tests.helpers import RECIPES, distdebug


def step_marks(path):
    events = json.load(gzip.open(path, "rt"))["traceEvents"]
    return sorted(int(m.group(1)) for e in events if (m := re.fullmatch(r"ProfilerStep#(\d+)", e.get("name", ""))))


def test_windows_hold_exactly_the_requested_steps_on_every_rank_and_are_analysed(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path), "--profile-steps", "3:5,8:8",
                  str(RECIPES / "ddp_convnet.py"), "--steps", "10")
    assert r.returncode == 0, r.output
    for window, steps in (("steps-3-5", [3, 4, 5]), ("steps-8-8", [8])):
        files = sorted((tmp_path / "traces" / window).glob("rank-*.pt.trace.json.gz"))
        assert [f.name for f in files] == ["rank-00000.pt.trace.json.gz", "rank-00001.pt.trace.json.gz"]
        for rank, f in enumerate(files):
            assert step_marks(f) == steps
            trace = json.load(gzip.open(f, "rt"))
            # Windows in the middle of the run end at their planned length: every mark is a step.
            assert trace["distdebug_window"] == {"planned": [steps[0], steps[-1]], "steps": [steps[0], steps[-1]]}
            # What Holistic Trace Analysis reads to place a trace: the rank and world size.
            assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
    rep = json.loads(distdebug("report", "--json", str(tmp_path)).stdout)
    w = rep["windows"][0]
    assert w["steps"] == [3, 5] and sorted(w["ranks"]) == ["0", "1"]
    for rank in ("0", "1"):
        a = w["ranks"][rank]
        assert a["device"] == "cpu" and [s["step"] for s in a["steps"]] == [3, 4, 5] and a["left_out"] == []
        assert 0 < a["comm_share"] < 1 and 0 <= a["overlap_ratio"] <= 1 and 0 < a["data_share"] < 0.5
        assert a["top_ops"] and all(s["compute_us"] > 0 for s in a["steps"])
    assert "Profiler windows" in distdebug("report", str(tmp_path)).stdout
    # the windows are paid once (their start, their steps under the profiler, their trace's export: what
    # those steps and the one after each took above the median step), apart from the steady cost per step
    # (issue 48, item 7): the profiler's own steady part is a set lookup a step
    for rank in ("0", "1"):
        cost = rep["harness_cost"]["ranks"][rank]
        assert cost["one_off"] == []  # the window's start and export are in its price, not said twice
        assert [w["steps"] for w in cost["profiler_windows"]] == ["3-5", "8-8"]
        assert all(w["extra_ms"] > 0 for w in cost["profiler_windows"])
        # A window's price counted as steady would add tens of ms a step (its export alone is hundreds of ms); a
        # set lookup is microseconds, and a loaded 2-core machine's preemptions add a few tenths of a ms (0.43
        # was seen in CI): the line between them, not a speed target (those live in bench/).
        assert cost["per_step_ms"].get("profiler", 0.0) < 1.0
        record = kinds(tmp_path, int(rank), "harness_cost")[-1]
        (spent, times), = record["one_off_ms"].values()  # counted once a window, claimed from the profiler
        assert times == 2 and spent > 0
    assert "USDT:" not in r.stderr and "profiler_start" not in r.stderr  # torch's profiler chatter stays ours


def test_a_window_past_the_end_holds_only_the_steps_it_covers(tmp_path):
    # The recipe's last step is 10; after it, a parameter digest, a print and destroy_process_group:
    # torch's profiler holds them in one more mark (11), which is the job's end, not a step.
    r = distdebug("attach", "--run-dir", str(tmp_path), "--profile-steps", "8:14",
                  str(RECIPES / "ddp_convnet.py"), "--steps", "10")
    assert r.returncode == 0, r.output
    assert [p.name for p in (tmp_path / "traces").iterdir()] == ["steps-8-10"]
    for f in sorted((tmp_path / "traces" / "steps-8-10").glob("rank-*.pt.trace.json.gz")):
        assert step_marks(f) == [8, 9, 10, 11]
        assert json.load(gzip.open(f, "rt"))["distdebug_window"] == {"planned": [8, 14], "steps": [8, 10]}
    (w,) = json.loads(distdebug("report", "--json", str(tmp_path)).stdout)["windows"]
    for a in w["ranks"].values():
        assert [s["step"] for s in a["steps"]] == [8, 9, 10] and [m["mark"] for m in a["left_out"]] == [11]


def test_a_finding_triggers_a_window_on_every_rank(tmp_path):
    # A corrupted step at 20 -> loss_spike at the boundary of step 20 -> a window of 5 steps that
    # starts at the first multiple of 8 at least 9 steps on: steps 32 to 36, on both ranks.
    r = distdebug("attach", "--run-dir", str(tmp_path), "--inject", "loss_spike", str(RECIPES / "ddp_convnet.py"),
                  "--steps", "38")
    assert r.returncode == 0, r.output
    files = sorted((tmp_path / "traces").glob("*/rank-*.gz"))
    assert [f"{f.parent.name}/{f.name}" for f in files] == ["steps-32-36/rank-00000.pt.trace.json.gz",
                                                            "steps-32-36/rank-00001.pt.trace.json.gz"]
    assert all(step_marks(f) == [32, 33, 34, 35, 36] for f in files)


def test_bad_profile_steps_is_one_line(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path / "x"), "--profile-steps", "1:5",
                  str(RECIPES / "ddp_convnet.py"))
    assert r.returncode == 2
    assert r.stderr.strip() == ("distdebug: error: --profile-steps 1:5: '1:5': need 2 <= A <= B (step 1 is when "
                                "the models are found)")

"""Tier 1 (pure functions): the decisions of the rank's watchdog and of the launcher's supervisor, on
given times, with no process and no clock. The end-to-end hang tests (tests/e2e/test_hang.py) prove the
whole path on real ranks; these prove each rule on its own, including the timings those runs cannot
reach (a grace period that has not passed yet, a rank heard a moment ago, a retry not due)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from distdebug.analysis.hang import BUSY_STALL, is_busy_stall, rendezvous_incomplete, stall_without_culprit
from distdebug.artifacts import layout, schema
from distdebug.findings import Severity
from distdebug.launch.supervisor import (
    DIAGNOSE_ALL,
    DIAGNOSE_SOME,
    END_JOB,
    GRACE_S,
    RENDEZVOUS_HANG,
    REPORT,
    RETRY,
    WAIT,
    WARN,
    Supervisor,
    poll_decision,
    verdict_decision,
)
from distdebug.runtime.watchdog import CLEARED, STALLED, STILL_STALLED, StallClock

TIMEOUT = 4.0


# ---------------------------------------------------------------- the watchdog (inside each rank)
def checks(clock: StallClock, progress: float, start: float, end: float, every: float = 0.5) -> list[tuple]:
    """(time, action) of every check the watchdog thread makes from start to end, progress fixed."""
    out, t = [], start
    while t <= end + 1e-9:
        out += [(round(t, 3), a) for a in clock.check(progress, t)]
        t += every
    return out


def test_no_stall_until_the_progress_is_older_than_the_timeout():
    clock = StallClock(TIMEOUT)
    assert checks(clock, progress=10.0, start=10.0, end=14.0) == []  # 4.0 s idle is not more than 4.0 s
    assert clock.check(10.0, 14.01) == [STALLED]


def test_a_stall_is_recorded_once_then_again_once_per_timeout_while_nothing_moves():
    clock = StallClock(TIMEOUT)
    got = checks(clock, progress=0.0, start=0.5, end=14.0)
    # Recorded at 4.5 (the first check past 4 s), again after each further 4 s: never more often.
    assert got == [(4.5, STALLED), (9.0, STILL_STALLED), (13.5, STILL_STALLED)]


def test_progress_clears_the_stall_and_a_later_stall_is_a_new_one():
    clock = StallClock(TIMEOUT)
    assert clock.check(0.0, 5.0) == [STALLED]
    assert clock.check(5.2, 5.5) == [CLEARED]  # the step moved on
    assert clock.check(5.2, 9.0) == []
    assert clock.check(5.2, 9.3) == [STALLED]  # a new stall, recorded as such (fresh stacks)


def test_before_its_first_step_a_rank_has_the_start_up_allowance_not_the_stall_timeout():
    """Ranks start unevenly: one waits in the first collective while another still builds its model (the
    fresh-clone CI killed healthy jobs so, with a 4 s stall timeout on a loaded machine). Until the rank has
    finished a step, only the start-up allowance makes a stall; after that, the stall timeout again."""
    clock = StallClock(TIMEOUT, startup=30.0)
    assert [a for t in (5.0, 20.0, 29.9) for a in clock.check(0.0, t, started=False)] == []
    assert clock.check(0.0, 30.1, started=False) == [STALLED]  # a start-up that never ends is still a hang
    assert clock.check(0.0, 45.0, started=False) == []  # recorded again once per start-up allowance
    assert clock.check(0.0, 60.2, started=False) == [STILL_STALLED]
    later = StallClock(TIMEOUT, startup=30.0)
    assert later.check(100.0, 104.5, started=True) == [STALLED]  # a step done: the stall timeout
    assert StallClock(TIMEOUT).startup == TIMEOUT  # none given: the stall timeout throughout


def test_a_busy_evaluation_of_three_timeouts_is_recorded_at_most_three_times():
    """The e2e test's long evaluation (12 s at a 4 s timeout): the warnings it gives are bounded by the
    watchdog's records, at most one per stall timeout."""
    clock = StallClock(TIMEOUT)
    got = checks(clock, progress=0.0, start=0.5, end=12.0)
    assert 1 <= len(got) <= 12.0 / TIMEOUT and got[0][1] == STALLED
    assert clock.check(12.1, 12.5) == [CLEARED]  # the evaluation ended: the next step cleared it


# ---------------------------------------------------------------- the supervisor (in the launcher)
def decide(now: float, **kw) -> str:
    args = dict(started=0.0, stall_timeout=TIMEOUT, pids={0, 1}, stalled={}, ended=set(), heard={},
                retry_at=0.0, has_children=lambda: True)
    args.update(kw)
    return poll_decision(now=now, **args)


def test_no_rank_started_is_a_rendezvous_hang_only_past_the_timeout_and_without_workers():
    assert decide(3.0, pids=set(), has_children=lambda: False) == WAIT  # within the timeout
    # Past it, workers that exist but have not written their first record (importing torch) are waited for.
    assert decide(5.0, pids=set(), has_children=lambda: True) == WAIT
    assert decide(5.0, pids=set(), has_children=lambda: False) == RENDEZVOUS_HANG


def test_workers_are_never_asked_about_while_ranks_have_started():
    def boom() -> bool:
        raise AssertionError("has_children called")

    assert decide(100.0, has_children=boom) == WAIT  # ranks started, none stalled


def test_every_live_rank_stalled_is_diagnosed_at_once():
    assert decide(10.0, stalled={0: 9.9, 1: 10.0}) == DIAGNOSE_ALL
    # A rank that ended (or raised) is not live: the ones left all stalled.
    assert decide(10.0, stalled={0: 10.0}, ended={1}) == DIAGNOSE_ALL


def test_a_rank_still_writing_records_is_waited_for_however_long_the_other_stalled():
    # Rank 0 stalled 60 s ago; rank 1 is slow but wrote a record 1 s ago: no kill without a culprit.
    assert decide(70.0, stalled={0: 10.0}, heard={0: 10.0, 1: 69.0}) == WAIT


def test_a_silent_rank_is_no_longer_waited_for_once_the_grace_period_is_over():
    heard = {0: 10.0, 1: 5.0}  # rank 1 silent since 5.0 (its watchdog cannot run: a native hang)
    assert decide(10.0 + GRACE_S - 0.1, stalled={0: 10.0}, heard=heard) == WAIT  # grace not over
    assert decide(10.0 + GRACE_S + 0.1, stalled={0: 10.0}, heard=heard) == DIAGNOSE_SOME
    # Silent, but for less than a stall timeout: still waited for.
    assert decide(10.0 + GRACE_S + 0.1, stalled={0: 10.0}, heard={0: 10.0, 1: 13.0}) == WAIT


def test_a_retry_that_is_not_due_waits():
    assert decide(10.0, stalled={0: 9.0, 1: 9.0}, retry_at=11.0) == WAIT
    assert decide(11.0, stalled={0: 9.0, 1: 9.0}, retry_at=11.0) == DIAGNOSE_ALL


def test_the_job_is_never_ended_without_a_culprit():
    for on_hang in ("abort", "report"):
        # No culprit while some rank has not stalled: look again shortly (it may yet show one).
        assert verdict_decision(busy=True, every=False, on_stall="warn", on_hang=on_hang) == RETRY
        assert verdict_decision(busy=True, every=False, on_stall="abort", on_hang=on_hang) == RETRY
        # No culprit, every rank stalled (a long evaluation): a warning, the job goes on.
        assert verdict_decision(busy=True, every=True, on_stall="warn", on_hang=on_hang) == WARN
    # A culprit: ended by default, reported only under --on-hang report.
    assert verdict_decision(busy=False, every=True, on_stall="warn", on_hang="abort") == END_JOB
    assert verdict_decision(busy=False, every=False, on_stall="warn", on_hang="abort") == END_JOB
    assert verdict_decision(busy=False, every=True, on_stall="warn", on_hang="report") == REPORT
    # --on-stall abort: the user asked for a stall without a culprit to end the job like a hang.
    assert verdict_decision(busy=True, every=True, on_stall="abort", on_hang="abort") == END_JOB
    assert verdict_decision(busy=True, every=True, on_stall="abort", on_hang="report") == REPORT


# ---------------------------------------------------------------- the supervisor's findings, built in analysis/
LAUNCH = Path(__file__).resolve().parents[2] / "distdebug" / "launch"


def test_the_launcher_builds_no_finding_of_its_own():
    """Verdicts are made in analysis/ only: the launcher hands analysis its facts and gets findings back."""
    built = [f"{p.name}:{n.lineno}" for p in sorted(LAUNCH.rglob("*.py")) for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Call) and (getattr(n.func, "id", None) == "Finding"
                                             or getattr(n.func, "attr", None) == "Finding")]
    assert built == []


def test_a_stall_with_nothing_to_name_is_a_warning_the_supervisor_reads_as_busy():
    f = stall_without_culprit([1, 0], 4.0)
    assert (f.severity, f.ranks, f.step, f.subject) == (Severity.WARNING, [0, 1], None, BUSY_STALL)
    assert f.message == "no progress for 4s on ranks [0, 1]; no culprit found: the job goes on"
    assert is_busy_stall([f])  # so verdict_decision never ends a job on it


def test_a_rendezvous_has_the_start_up_allowance():
    assert decide(5.0, pids=set(), has_children=lambda: False, startup_timeout=30.0) == WAIT
    assert decide(30.5, pids=set(), has_children=lambda: False, startup_timeout=30.0) == RENDEZVOUS_HANG


def test_the_default_start_up_allowance_is_never_shorter_than_the_stall_timeout(tmp_path):
    from distdebug.config import STARTUP_FLOOR_S, AttachConfig

    script = tmp_path / "s.py"
    script.write_text("")
    assert AttachConfig(target=str(script), stall_timeout=4.0).startup_allowance == STARTUP_FLOOR_S
    assert AttachConfig(target=str(script), stall_timeout=4000.0).startup_allowance == 4000.0
    assert AttachConfig(target=str(script), stall_timeout=4.0, startup_timeout=9.0).startup_allowance == 9.0


def test_an_incomplete_rendezvous_names_the_nodes_whose_launcher_never_came(tmp_path):
    f = rendezvous_incomplete(expected_nodes=3, present=[0, 2], stall_timeout=30.0, host="h")
    assert (f.severity, f.ranks, f.subject) == (Severity.CRITICAL, [], "rendezvous")
    assert f.message.endswith("launchers seen in this run directory: nodes [0, 2]; missing: nodes [1]")
    assert f.evidence["nodes_missing"] == [1]
    # The supervisor reads the node files and the rank folders through the run directory's layout.
    for node in (0, 2):
        layout.node_path(tmp_path, node).parent.mkdir(parents=True, exist_ok=True)
        layout.node_path(tmp_path, node).write_text("{}")
    layout.events_path(tmp_path, 3).parent.mkdir(parents=True)
    layout.events_path(tmp_path, 3).write_text(json.dumps(schema.record(schema.START, rank=3, pid=42, host="h")) + "\n")
    sup = Supervisor(tmp_path, stall_timeout=30.0, on_hang="report", node_rank=0, expected_nodes=3)
    sup._scan()
    assert sup._pids == {3: 42}
    sup._rendezvous_hang()
    assert sup.verdict is not None and sup.verdict[0].evidence["nodes_missing"] == [1]
    assert [json.loads(line)["subject"] for line in layout.run_findings_path(tmp_path).read_text().splitlines()] \
        == ["rendezvous"]

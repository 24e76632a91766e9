"""Tier 1: the log-volume guard (issue 48, item 6): what the environment turns on, the hours until a file
system is full with a bounded part, doctor's static check, and the launcher's guard on real files with a
clock the test moves (each warning beside its clean twin). The guard's prediction against what a real job
then wrote is tests/e2e/test_volume.py."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from distdebug.artifacts import layout, schema
from distdebug.doctor.checks import PASS, WARN, check_volume
from distdebug.doctor.volume import (
    NCCL_COLL_LINE,
    env_logs,
    fill_hours,
    nccl_subsystems,
    static_lines,
    summary_text,
)
from distdebug.launch.volume import Destination, VolumeGuard, expected_hours

HOST = "node-a"


def test_nccl_subsystems_as_nccl_reads_them():
    assert nccl_subsystems(None) == {"INIT", "BOOTSTRAP", "ENV"}  # NCCL's default: start-up lines only
    assert "COLL" in nccl_subsystems("ALL") and "COLL" in nccl_subsystems("init,coll")
    assert "COLL" not in nccl_subsystems("^COLL") and "INIT" in nccl_subsystems("^COLL")
    assert "COLL" in nccl_subsystems("^INIT")


def test_env_logs_per_collective_only_where_nccl_logs_collectives():
    (nccl,) = env_logs({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "ALL"})
    assert (nccl.per_collective, nccl.target) == (NCCL_COLL_LINE, "stdout") and "NCCL_DEBUG_SUBSYS" in nccl.fix
    (trace,) = env_logs({"NCCL_DEBUG": "TRACE", "NCCL_DEBUG_SUBSYS": "COLL", "NCCL_DEBUG_FILE": "/l/n.%h.%p"})
    assert trace.per_collective == NCCL_COLL_LINE and trace.target == "/l/n.%h.%p"
    # twins: INFO with its default subsystems, WARN, torch's own debug variables: start-up lines, no rate
    (init,) = env_logs({"NCCL_DEBUG": "INFO"})
    assert init.per_collective == 0 and init.once > 0
    assert env_logs({"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "ALL"}) == []
    (torch_log,) = env_logs({"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_CPP_LOG_LEVEL": "INFO"})
    assert torch_log.per_collective == 0
    assert torch_log.setting == "TORCH_DISTRIBUTED_DEBUG=DETAIL TORCH_CPP_LOG_LEVEL=INFO"
    assert env_logs({}) == []


def test_fill_hours_with_a_bounded_part():
    assert fill_hours(100, [(10, None)]) == pytest.approx(10)
    assert fill_hours(100, [(10, None), (10, None)]) == pytest.approx(5)
    # the bounded part (the run directory's budget) stops at 40 after 4 h; then 10 an hour alone: 4 + 5 h
    assert fill_hours(100, [(10, None), (10, 40)]) == pytest.approx(4 + (100 - 80) / 10)
    assert math.isinf(fill_hours(100, [(10, 40)]))  # the budget fits: never
    assert fill_hours(100, [(50, 400)]) == pytest.approx(2)  # the budget does not fit: full before it is reached
    assert math.isinf(fill_hours(100, [])) and math.isinf(fill_hours(100, [(0, None)]))
    assert fill_hours(0, [(1, None)]) == 0


def test_doctor_shows_the_static_part(tmp_path):
    run = str(tmp_path / "runs")
    warn, lines, fixes = static_lines({}, run_dir=run, budget=256 << 20, ranks=8)
    assert not warn and "at most 2 GiB (8 x 256 MiB budget)" in lines[0] and not fixes
    warn, lines, fixes = static_lines({}, run_dir=run, budget=1 << 60, ranks=8)  # more than any disk here
    assert warn and "more than is free" in lines[0] and "--run-dir-budget" in fixes[0]
    warn, lines, fixes = static_lines({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "ALL"}, run_dir=run,
                                      budget=256 << 20, ranks=8)
    # 200 B x 100 collectives a second x 3,600 s x 8 ranks
    assert warn and "a line per collective per rank to stdout (200 B): 549 MiB an hour" in lines[1]
    env = {"DISTDEBUG_RUN_DIR": run, "LOCAL_WORLD_SIZE": "2", "NCCL_DEBUG": "INFO"}
    c = check_volume(env)
    assert c.status == PASS and "2 x 256 MiB" in c.detail and "NCCL_DEBUG=INFO: about 24 KiB per rank" in c.detail
    assert check_volume({**env, "NCCL_DEBUG_SUBSYS": "COLL"}).status == WARN


def test_expected_hours_and_log_dir():
    assert expected_hours(5.0, {}, 0) == (5.0, "--expected-hours")
    hours, source = expected_hours(None, {"SLURM_JOB_END_TIME": "7200"}, 0)
    assert hours == 2 and "Slurm" in source
    hours, source = expected_hours(None, {"SLURM_JOB_END_TIME": "7200"}, 8000)  # past: the default
    assert hours == 24 and "--expected-hours" in source
    guard = VolumeGuard(Path("/run"), budget=0, expected=1.0, log_dir="/l", streams=[])
    assert [(d.key, d.path, d.walk) for d in guard.dests] == [("run", "/run", False), ("log_dir", "/l", True)]
    bare = VolumeGuard(Path("/run"), budget=0, expected=1.0, log_dir=None, streams=[])
    assert [d.key for d in bare.dests] == ["run"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _guard(tmp_path: Path, *, expected: float, env: dict[str, str] | None = None, streams=None, budget=0,
           node_rank=0):
    run = tmp_path / "run"
    for rank in (0, 1):
        layout.rank_dir(run, rank).mkdir(parents=True, exist_ok=True)
    clock = Clock()
    guard = VolumeGuard(run, budget=budget, expected=expected, log_dir=None, env=env or {}, window_s=60,
                        recheck_s=600, host=HOST, clock=clock, streams=[] if streams is None else streams,
                        is_local=lambda start: start.get("host") == HOST, node_rank=node_rank)
    for rank in (0, 1):
        guard.feed(rank, {"kind": schema.START, "host": HOST, "pid": 1})
    guard.feed(2, {"kind": schema.START, "host": "node-b", "pid": 1})  # another node's rank: not ours
    return run, clock, guard


def _stdout_guard(tmp_path: Path, expected: float) -> tuple[Path, Clock, VolumeGuard]:
    """A guard whose launcher's stdout is a file (a batch job's output file)."""
    out = tmp_path / "slurm.out"
    _, clock, guard = _guard(tmp_path, expected=expected,
                             streams=[Destination("stdout", "stdout", str(out), [str(out)])])
    return out, clock, guard


def _steps(guard: VolumeGuard, step: int, collectives: int = 0) -> None:
    for rank in (0, 1):
        guard.feed(rank, {"kind": schema.STEP, "step": step, "collectives": collectives})


def _grow(path: Path, n: int) -> None:
    with open(path, "ab") as f:
        f.write(b"x" * n)


def test_the_guard_measures_after_the_second_step_and_warns_once(tmp_path):
    out = tmp_path / "slurm.out"
    out.write_bytes(b"start-up lines, before the window\n" * 100)
    run, clock, guard = _guard(tmp_path, expected=1e9,
                               streams=[Destination("stdout", f"stdout ({out})", str(out), [str(out)])])
    assert guard.local == {0, 1}
    _steps(guard, 1)
    assert guard.poll() == [] and guard.t0 is None  # not before every local rank finished its second step
    _steps(guard, 2)
    assert guard.poll() == [] and guard.t0 == 1000.0
    _grow(out, 6000)
    _grow(layout.events_path(run, 0), 600)
    clock.now += 59
    assert guard.poll() == [] and guard.t1 is None  # the window is a minute
    clock.now += 1
    (f,) = guard.poll()
    assert guard.rates == {"run": 600 * 60, "stdout": 6000 * 60}  # bytes an hour
    assert f.detector == "log_volume" and f.ranks == [0, 1] and f.step == 2 and f.subject == str(
        _mount(tmp_path)) and "stdout" in f.message and "print less often" in (f.fix or "")
    assert f.evidence["bytes_per_hour"] == {"run": 36000, "stdout": 360000}
    clock.now += 600
    _grow(out, 6000)
    assert guard.poll() == []  # said once per file system
    summary = guard.summary()
    assert summary is not None and summary["measured"] and summary["warned"] == [str(_mount(tmp_path))]
    assert {d["key"]: d["written_bytes_per_hour"] for d in summary["destinations"]} == {"run": 0, "stdout": 36000}
    assert "stdout" in (summary_text(summary) or "")


def test_its_clean_twin_a_job_that_fits_says_nothing(tmp_path):
    out, clock, guard = _stdout_guard(tmp_path, expected=1.0)
    _steps(guard, 2)
    guard.poll()
    _grow(out, 6000)
    clock.now += 60
    assert guard.poll() == [] and guard.rates["stdout"] == 360000
    fs = guard.fills[str(_mount(tmp_path))]
    assert fs["hours_to_fill"] > 1 and fs["bytes_per_hour"] == 360000


def test_nccl_lines_to_a_pipe_are_predicted_from_the_collectives_counted(tmp_path):
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "ALL"}
    run, clock, guard = _guard(tmp_path, expected=1.0, env=env)  # no stream: the console is a pipe
    _steps(guard, 2)
    guard.poll()
    for step in range(3, 13):
        _steps(guard, step, collectives=6)  # 10 steps x 6 collectives x 2 ranks in the minute
    clock.now += 60
    (f,) = guard.poll()
    assert guard.predicted == {"NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ALL": pytest.approx(120 / 60 * 200 * 3600)}
    assert "to the console (not a file: not measured)" in (summary_text(guard.summary()) or "")
    # 1.4 MiB an hour for the hour left: said, with where it goes unknown, as a note
    assert (f.severity, f.subject, f.step) == ("info", "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ALL", 12)
    assert "not a file here" in f.message and "at least 1.37 MiB an hour" in f.message
    _, clock, long_job = _guard(tmp_path / "long", expected=2000.0, env=env)
    _steps(long_job, 2)
    long_job.poll()
    for step in range(3, 13):
        _steps(long_job, step, collectives=6)
    clock.now += 60
    (f,) = long_job.poll()
    assert f.severity == "warning"  # 2.7 GiB by the job's expected end
    _, clock, twin = _guard(tmp_path / "twin", expected=2000.0, env={"NCCL_DEBUG": "INFO"})
    _steps(twin, 2)
    twin.poll()
    for step in range(3, 13):
        _steps(twin, step, collectives=6)
    clock.now += 60
    assert twin.poll() == [] and twin.predicted == {}  # start-up lines only: no rate


def test_an_nccl_debug_file_is_measured_and_its_fix_given(tmp_path):
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "COLL", "NCCL_DEBUG_FILE": str(tmp_path / "nccl.%h.%p")}
    run, clock, guard = _guard(tmp_path, expected=1e9, env=env)
    guard.host = f"{HOST}.example.org"  # a fully qualified name: NCCL substitutes the part before the first dot
    guard.dests = guard._destinations(None, [])
    _steps(guard, 2)
    guard.poll()
    for pid in (11, 12):
        _grow(tmp_path / f"nccl.{HOST}.{pid}", 3000)
    _grow(tmp_path / "nccl.node-b.13", 3000)  # another host's file: not this node's
    _grow(tmp_path / f"nccl.{HOST}.example.org.14", 3000)  # NCCL's %h is the short host name: never this
    clock.now += 60
    (f,) = guard.poll()
    assert guard.rates["nccl_file"] == 6000 * 60 and "NCCL_DEBUG_SUBSYS=INIT,ENV" in (f.fix or "")


def test_the_run_directory_stops_at_its_budget(tmp_path):
    run, clock, guard = _guard(tmp_path, expected=1e9, budget=1 << 20)
    _steps(guard, 2)
    guard.poll()
    _grow(layout.events_path(run, 1), 6000)
    clock.now += 60
    assert guard.poll() == []  # 2 ranks x 1 MiB: it fits whatever the job's length
    assert guard.fills[str(_mount(tmp_path))]["hours_to_fill"] is None
    _, clock, unbounded = _guard(tmp_path / "b", expected=1e9, budget=0)
    _steps(unbounded, 2)
    unbounded.poll()
    _grow(layout.events_path(tmp_path / "b" / "run", 1), 6000)
    clock.now += 60
    (f,) = unbounded.poll()
    assert "--run-dir" in (f.fix or "")


def test_a_failing_guard_turns_itself_off(tmp_path):
    run, clock, guard = _guard(tmp_path, expected=1.0)

    def broken() -> dict[str, int]:
        raise OSError("stat failed")

    guard._sizes = broken  # type: ignore[method-assign]
    _steps(guard, 2)
    assert guard.poll() == [] and guard.off == "OSError: stat failed"
    assert guard.poll() == [] and guard.summary() == {"measured": False, "why": "OSError: stat failed"}


def _mount(path: Path) -> Path:
    p = path.resolve()
    dev = os.stat(p).st_dev
    while p.parent != p and os.stat(p.parent).st_dev == dev:
        p = p.parent
    return p


def test_a_restarted_attempt_keeps_the_guard_on(tmp_path):
    out, clock, guard = _stdout_guard(tmp_path, expected=1e9)
    _steps(guard, 1)
    guard.feed(0, {"kind": schema.SCRIPT_ERROR})  # the first attempt fails at step 1 (--max-restarts)
    guard.poll()
    for rank in (0, 1):
        guard.feed(rank, {"kind": schema.START, "host": HOST, "pid": 2, "attempt": 1})
    _steps(guard, 1)
    guard.poll()
    assert guard.t0 is None  # the new attempt's start-up is not a rate
    _steps(guard, 2)
    guard.poll()
    _grow(out, 6000)
    clock.now += 60
    (f,) = guard.poll()
    assert f.subject == str(_mount(tmp_path))


def test_a_later_look_averages_since_the_window(tmp_path):
    out, clock, guard = _stdout_guard(tmp_path, expected=24.0)
    _steps(guard, 2)
    guard.poll()
    clock.now += 60
    assert guard.poll() == []
    free = guard.fills[str(_mount(tmp_path))]["free_bytes"]
    clock.now += 600
    _grow(out, 1 << 20)  # one burst of 1 MiB in ten minutes (an evaluation's dump): 6 MiB an hour, not more
    assert guard.poll() == []
    fs = guard.fills[str(_mount(tmp_path))]
    assert fs["bytes_per_hour"] == pytest.approx((1 << 20) / (600 / 3600))
    assert fs["hours_to_fill"] == pytest.approx(free / fs["bytes_per_hour"], rel=0.01)


def test_a_shared_run_directory_is_reckoned_for_every_node_and_said_by_node_0(tmp_path):
    run, clock, guard = _guard(tmp_path, expected=1e9, node_rank=1)
    for node in (0, 1):
        path = layout.node_path(run, node)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    _steps(guard, 2)
    guard.poll()
    _grow(layout.events_path(run, 0), 600)
    clock.now += 60
    assert guard.poll() == []  # node 1: node 0 speaks for the shared file system
    assert guard.fills == {}
    _, clock0, guard0 = _guard(tmp_path, expected=1e9, node_rank=0)
    _steps(guard0, 2)
    guard0.poll()
    _grow(layout.events_path(run, 0), 600)
    clock0.now += 60
    (f,) = guard0.poll()
    assert f.evidence["bytes_per_hour"]["run"] == 2 * 600 * 60  # this node's rate for each of the 2 nodes


def test_the_fix_is_for_what_fills_the_disk_by_then():
    from distdebug.analysis.volume import Part, fill_finding

    gib = float(1 << 30)
    parts = [Part("run", "run directory", gib, 0.5 * gib), Part("stdout", "stdout", 0.2 * gib)]
    hours = fill_hours(1.5 * gib, [(p.bytes_per_hour, p.cap) for p in parts])
    assert hours == pytest.approx(0.5 + (1.5 - 0.6) / 0.2)  # 0.6 GiB in the first half hour, then stdout alone
    f = fill_finding(mount="/fs", free=int(1.5 * gib), hours=hours, hours_left=24, parts=parts, logs=[],
                     budget=256 << 20, over="over the first 60 s of steps", expected_source="x", ranks=[0], step=9)
    assert "print less often" in (f.fix or "")  # stdout writes 1 GiB by then, the bounded run directory 0.5
    assert f.message.startswith("the file system of /fs (1.5 GiB free) fills in 5.0 hours at the rate this node "
                                "wrote over the first 60 s of steps: stdout 205 MiB an hour, run directory 1 GiB an "
                                "hour (at most 512 MiB more: its budget)")


def test_a_bad_window_variable_never_stops_a_launch(tmp_path):
    guard = VolumeGuard(tmp_path, budget=0, expected=1.0, log_dir=None, env={"DISTDEBUG_VOLUME_WINDOW_S": "3s"},
                        streams=[])
    assert guard.window_s == 60.0


def test_a_look_that_hangs_stops_the_guard_alone(tmp_path):
    # a destination on a file system that hangs (an NFS server gone): the guard's looks run on their own
    # thread, so the supervisor goes on reading the ranks' records (its hang detection), and attach still
    # gets its summary line in time to return the job's exit code
    import json
    import threading
    import time

    from distdebug.launch.supervisor import Supervisor

    hung = threading.Event()
    fed: list[dict] = []

    class HungGuard:
        off = None

        def feed(self, rank, rec):
            fed.append(rec)

        def poll(self):
            hung.wait(30)  # a stat that does not return
            return []

    events = layout.events_path(tmp_path, 0)
    events.parent.mkdir(parents=True)
    events.write_text(json.dumps(schema.record(schema.START, rank=0, pid=1, host=HOST)) + "\n")
    sup = Supervisor(tmp_path, stall_timeout=60, on_hang="report", node_rank=0, expected_nodes=1, interval=0.05,
                     guard=HungGuard())  # type: ignore[arg-type]
    try:
        sup.start()
        deadline = time.monotonic() + 10
        while not fed and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(events, "a") as f:
            f.write(json.dumps(schema.record(schema.STEP, rank=0, step=1)) + "\n")
        while len(fed) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r["kind"] for r in fed] == [schema.START, schema.STEP]  # read while the guard's look hangs
        t0 = time.monotonic()
        sup.stop()
        assert time.monotonic() - t0 < 8
    finally:
        hung.set()

    _, _, guard = _guard(tmp_path / "g", expected=1.0)
    stuck = threading.Event()
    guard.summary = lambda: stuck.wait(30) and None  # type: ignore[method-assign]
    t0 = time.monotonic()
    assert guard.summary_within(0.2) == {"measured": False, "why": "a destination did not answer within 0.2 s"}
    assert time.monotonic() - t0 < 5
    stuck.set()

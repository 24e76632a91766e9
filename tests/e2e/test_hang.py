"""Tier 3 (end to end): hangs and failed collectives under attach, diagnosed and ended, nothing left behind.

Each run uses a short --stall-timeout so that a hang is noticed in seconds; each test bounds its run
with a timeout of stall-timeout + 30 s and the helpers kill every process on the way out.

Needs: 2 ranks (one culprit, one peer that waits for it; 3 where a flag must be said once among
several ranks, 1 per node for the missing-node rendezvous) and hang.py's 5 steps with the fault at step
2-3: collectives before the fault, so that the counts per rank differ where it strikes. STALL is as
short as a verdict allows on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from distdebug.artifacts import layout
from distdebug.artifacts.reader import read_events
from distdebug.config import EXIT_HANG
from tests.e2e.conftest import HANG_STALL_S, SHARED
from tests.helpers import DATA, ROOT, distdebug, free_port, kill_tree, make_env

SCRIPT = str(DATA / "scripts" / "hang.py")
STALL = HANG_STALL_S


def script_line(code: str) -> int:
    """The line of hang.py where code is (the tests read it, so that an edit of the script moves it)."""
    return next(i for i, text in enumerate(Path(SCRIPT).read_text().splitlines(), 1) if code in text)


def run_findings(run_dir):
    records, _ = read_events(layout.run_findings_path(run_dir))
    return [r for r in records if r["kind"] == "finding"]


def attach(run_dir, *script_args, extra=(), timeout=60):
    return distdebug("attach", "--run-dir", str(run_dir), "--stall-timeout", STALL, *extra, SCRIPT, *script_args,
                     timeout=timeout)


@pytest.mark.waits  # its ranks sleep through a stall timeout or a hang: it may run beside a CPU-bound test
@pytest.mark.smoke
@pytest.mark.xdist_group(SHARED)
def test_rank_that_skips_an_allreduce_is_named_with_step_collective_and_stack(skipped_allreduce_run):
    tmp_path, r = skipped_allreduce_run.run_dir, skipped_allreduce_run.result
    assert r.returncode == EXIT_HANG, r.output
    # From the moment rank 0 stopped making progress to the job's end: within stall-timeout + 10 s.
    stall0 = [x for x in read_events(layout.events_path(tmp_path, 0))[0] if x["kind"] == "stall"][-1]
    ended = json.loads((tmp_path / "nodes" / "node-000.json").read_text())["ended"]
    assert ended - (stall0["time"] - stall0["idle_s"]) < float(STALL) + 10
    # No rank left behind.
    pids = [x["pid"] for rank in (0, 1) for x in read_events(layout.events_path(tmp_path, rank))[0]
            if x["kind"] == "start"]
    assert len(pids) == 2 and not [p for p in pids if psutil.pid_exists(p)
                                   and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    (f,) = [f for f in run_findings(tmp_path) if f["detector"] == "hang"]
    assert f["ranks"] == [1] and f["step"] == 3  # the step where rank 1 made fewer collectives
    # Rank 1's later all_reduces paired with rank 0's earlier ones, so the job hangs only in the last
    # one (#5); the verdict still points at step 3 and shows rank 1's own stack.
    assert "all_reduce #5" in f["subject"] and "ranks [0] wait in" in f["message"]
    assert "hang.py" in f["message"] and "time.sleep(600)" in f["message"]
    assert f["evidence"]["first_step_with_different_collective_counts"] == {
        "step": 3, "collectives_per_rank": {"0": 1, "1": 0}}
    assert f["evidence"]["flight_recorder"]["missing_ranks"] == [1]
    assert "hang rank(s) 1 step 3" in r.stderr.replace("CRITICAL ", "")
    assert (tmp_path / "rank-00001" / "stacks.txt").read_text().count("Thread") >= 2
    assert (tmp_path / "rank-00000" / "fr_trace.pkl").exists()
    rep = json.loads(distdebug("report", "--json", str(tmp_path)).stdout)
    assert rep["exit_code"] == EXIT_HANG
    # The skipped gradient sync also shows as what it did to the replicas, at the same step.
    hang, diverged = rep["findings"]
    assert hang["detector"] == "hang" and diverged["detector"] == "replica_divergence"
    assert diverged["step"] == 3 and diverged["subject"] == "weight" and diverged["ranks"] == [0, 1]


@pytest.mark.waits  # its ranks sleep through a stall timeout or a hang: it may run beside a CPU-bound test
def test_rank_sleeping_forever_inside_its_step(tmp_path):
    r = attach(tmp_path, "--sleep-at", "3")
    assert r.returncode == EXIT_HANG, r.output
    (f,) = run_findings(tmp_path)
    assert (f["ranks"], f["step"]) == ([1], 3)
    assert "all_reduce #3" in f["subject"] and "ranks [0] wait in" in f["message"]
    assert "time.sleep(600)  # stuck inside its step" in f["message"]
    stall = [x for x in read_events(layout.events_path(tmp_path, 1))[0] if x["kind"] == "stall"][-1]
    assert stall["phase"] == "training" and stall["in_collective"] is None
    stall0 = [x for x in read_events(layout.events_path(tmp_path, 0))[0] if x["kind"] == "stall"][-1]
    assert stall0["in_collective"]["op"] == "all_reduce" and stall0["in_collective"]["seq"] == 3


def test_collective_with_different_sizes_across_ranks(tmp_path):
    r = attach(tmp_path, "--size-at", "3")
    assert r.returncode != 0, r.output
    (f,) = run_findings(tmp_path)
    assert f["subject"] == "collective #3" and f["ranks"] == [0, 1] and f["step"] == 3
    assert "rank 0 all_reduce [[20]]" in f["message"] and "rank 1 all_reduce [[40]]" in f["message"]
    # rank 0 was aborted by gloo (no Python ran): its place comes from the faulthandler dump
    line = script_line("dist.all_reduce(flat)")
    assert f"rank 0 died by a fatal signal at step 3 in hang.py:{line} in <module>" in f["message"]


@pytest.mark.waits  # its ranks sleep through a stall timeout or a hang: it may run beside a CPU-bound test
def test_rank_that_exits_early_is_named(tmp_path):
    r = attach(tmp_path, "--exit-at", "3")
    assert r.returncode != 0, r.output
    (f,) = run_findings(tmp_path)
    assert f["ranks"] == [1] and "rank 1 exited with code 0 after step 2" in f["message"]
    assert "all_reduce #3" in f["subject"]


@pytest.mark.waits  # its ranks sleep through a stall timeout or a hang: it may run beside a CPU-bound test
def test_slow_but_progressing_rank_is_not_a_hang(tmp_path):
    # Slow to start (rank 1 sleeps 2.5x the stall timeout after init_process_group while rank 0 waits in
    # the first all_reduce: a rank loading a large checkpoint; the start-up allowance covers it), then
    # slow at every step (1.2 s more a step, under the stall timeout: progress).
    r = attach(tmp_path, "--slow", "1.2", "--steps", "8", "--slow-start", str(2.5 * float(STALL)))
    assert r.returncode == 0, r.output
    assert run_findings(tmp_path) == []
    for rank in (0, 1):
        assert not [x for x in read_events(layout.events_path(tmp_path, rank))[0] if x["kind"] == "stall"]


@pytest.mark.waits  # its ranks sleep through a stall timeout or a hang: it may run beside a CPU-bound test
def test_rank_stuck_before_init_process_group(tmp_path):
    r = attach(tmp_path, "--init-late", extra=("--startup-timeout", STALL))  # a hang at start-up
    assert r.returncode == EXIT_HANG, r.output
    (f,) = run_findings(tmp_path)
    assert f["subject"] == "init_process_group" and f["ranks"] == [1]
    assert "ranks [0] wait in init_process_group" in f["message"]
    assert "rank 1 never called it" in f["message"] and "time.sleep(600)" in f["message"]


@pytest.mark.waits  # its ranks sleep through a stall timeout or a hang: it may run beside a CPU-bound test
def test_collective_timeout_surfaces_as_a_finding_and_non_zero_exit(tmp_path):
    # The process group's own timeout (2 s) fires before distdebug's stall timeout (300 s).
    r = distdebug("attach", "--run-dir", str(tmp_path), SCRIPT, "--sleep-at", "2", "--pg-timeout", "2", timeout=90)
    assert r.returncode != 0
    (f,) = run_findings(tmp_path)
    assert f["ranks"] == [1] and "all_reduce #2" in f["subject"] and "ranks [0] wait in" in f["message"]
    err = [x for x in read_events(layout.events_path(tmp_path, 0))[0] if x["kind"] == "script_error"][0]
    assert err["collective"] == "all_reduce" and err["flight_recorder"] is True


def test_async_error_handling_off_is_flagged_once(tmp_path):
    # One environment check (doctor's), made once per node: not once by the launcher and once more
    # in every rank with another wording and fix.
    from distdebug.doctor.checks import WARN, check_variables

    (c,) = check_variables({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "NCCL_DEBUG": "INFO"}, ["lo"], False)
    assert (c.name, c.status) == ("TORCH_NCCL_ASYNC_ERROR_HANDLING", WARN) and "hangs the job" in c.detail
    assert check_variables({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, ["lo"], False) == []  # on is the safe value
    r = distdebug("attach", "--run-dir", str(tmp_path), "--nproc-per-node", "3", SCRIPT, "--steps", "2",
                  env=make_env(TORCH_NCCL_ASYNC_ERROR_HANDLING="0"))
    assert r.returncode == 0, r.output
    rep = json.loads(distdebug("report", "--json", str(tmp_path)).stdout)
    (f,) = [x for x in rep["findings"] if x["subject"] == "TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    assert (f["detector"], f["ranks"], f["severity"]) == ("env_check", [0], "warning")
    assert "hangs the job" in f["message"] and f["fix"].startswith("unset TORCH_NCCL_ASYNC_ERROR_HANDLING")


@pytest.mark.waits  # its ranks sleep through a stall timeout or a hang: it may run beside a CPU-bound test
def test_report_only_mode_keeps_waiting(tmp_path):
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "attach", "--run-dir", str(tmp_path),
                             "--stall-timeout", STALL, "--on-hang", "report", SCRIPT, "--sleep-at", "2"],
                            env=make_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not run_findings(tmp_path):
            time.sleep(0.5)
        (f,) = run_findings(tmp_path)
        assert f["ranks"] == [1]
        time.sleep(3)
        assert proc.poll() is None  # still waiting, as asked
    finally:
        kill_tree(proc.pid)


@pytest.mark.waits  # its ranks sleep through a stall timeout or a hang: it may run beside a CPU-bound test
def test_rendezvous_that_never_completes_names_the_missing_node(tmp_path):
    port = free_port()
    r = distdebug("attach", "--run-dir", str(tmp_path), "--startup-timeout", STALL, "--nnodes", "2",
                  "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                  "--rdzv-id", "lonely", SCRIPT, timeout=60)
    assert r.returncode == EXIT_HANG, r.output
    (f,) = run_findings(tmp_path)
    assert f["subject"] == "rendezvous" and f["evidence"]["nodes_missing"] == [1]
    assert json.loads((tmp_path / "nodes" / "node-000.json").read_text())["node_rank"] == 0


@pytest.mark.waits  # its ranks sleep through a stall timeout or a hang: it may run beside a CPU-bound test
def test_every_rank_busy_beyond_the_stall_timeout_is_a_warning_not_a_kill(tmp_path):
    # Both ranks evaluate for 3x the stall timeout between steps 2 and 3 (no collective pending): a
    # healthy job. It runs to the end with exit 0; the stall is a warning with both ranks' stacks,
    # repeated at most once per stall timeout.
    busy = 3 * float(STALL)
    r = attach(tmp_path, "--busy", "2", str(busy), timeout=busy + 60)
    assert r.returncode == 0, r.output
    assert "rank 0 done" in r.stdout and "rank 1 done" in r.stdout
    stalls = [f for f in run_findings(tmp_path) if f["detector"] == "hang"]
    assert 1 <= len(stalls) <= busy / float(STALL), stalls
    for f in stalls:
        assert (f["severity"], f["subject"], f["ranks"], f["step"]) == ("warning", "stall", [0, 1], 3)
        assert "the job goes on" in f["message"]
        assert "rank 0 is in hang.py:" in f["message"] and "rank 1 is in hang.py:" in f["message"]
        assert set(f["evidence"]["stacks"]) == {"0", "1"}
    assert "training failed" not in r.stderr
    rep = json.loads(distdebug("report", "--json", str(tmp_path)).stdout)
    assert rep["exit_code"] == 0 and all(x["steps"] == 5 for x in rep["ranks"])


@pytest.mark.waits  # its ranks sleep through a stall timeout or a hang: it may run beside a CPU-bound test
def test_on_stall_abort_ends_a_busy_job_as_asked(tmp_path):
    r = attach(tmp_path, "--busy", "2", "60", extra=("--on-stall", "abort"), timeout=60)
    assert r.returncode == EXIT_HANG, r.output
    (f,) = [f for f in run_findings(tmp_path) if f["detector"] == "hang"]
    assert (f["subject"], f["ranks"]) == ("stall", [0, 1])


def test_a_collective_called_by_keywords_with_different_sizes_names_each_ranks_sizes(tmp_path):
    # DeepSpeed's MoE dispatch calls all_to_all_single(output=..., input=...): the shapes are read from
    # keywords as well as positions (they were "sizes None" before). gloo aborts rank 0 (it receives
    # more than it expects); rank 1 raises in the same call, or has already gone on to the next one.
    r = attach(tmp_path, "--a2a-size-at", "3")
    assert r.returncode != 0, r.output
    (f,) = run_findings(tmp_path)
    assert 0 in f["ranks"] and f["step"] == 4  # after the 3rd optimizer step: step 4's work
    r0 = f["evidence"]["ranks"]["0"]["in_collective"]
    line = script_line("dist.all_to_all_single(")
    assert (r0["op"], r0["shapes"], r0["site"]["line"]) == ("all_to_all_single", [[12], [12]], line)
    if "ranks disagree" in f["message"]:
        assert "rank 0 all_to_all_single [[12], [12]], rank 1 all_to_all_single [[16], [16]]" in f["message"], f
    one = f["evidence"]["ranks"]["1"]
    if one["status"] == "raised":
        assert one["error"].startswith("RuntimeError")  # the backend's own message

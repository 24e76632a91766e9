"""Tier 3 (CLI): a running job seen from another terminal (issue 39): ``distdebug stacks``.

Needs: 3 ranks (one asleep, two waiting for it in the collective: two groups, one of two ranks); a sleep
of 8 s a step on rank 1, so that the stacks are asked while it sleeps (the others are then inside step
2's all_reduce), and 3 steps, so that the job then finishes by itself.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from distdebug.artifacts import layout
from distdebug.procs import kill_tree
from tests.e2e.test_attach import kinds
from tests.helpers import DATA, ROOT, distdebug, make_env

SCRIPT = str(DATA / "scripts" / "handwritten_allreduce.py")


@pytest.mark.waits  # its ranks sleep and wait: it may run beside a CPU-bound test
def test_stacks_of_a_running_job_name_the_sleeping_rank_and_the_others_in_the_collective(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "attach", "--nproc-per-node", "3", "--run-dir",
                             str(run), SCRIPT, "--steps", "3", "--sleep", "8", "--sleep-rank", "1"],
                            env=make_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 90
        while time.time() < deadline and not all(
                layout.events_path(run, r).exists() and kinds(run, r, "step") for r in range(3)):
            time.sleep(0.2)
        assert all(kinds(run, r, "step") for r in range(3)), "the ranks did not finish step 1"
        # rank 1 asleep after step 1; ranks 0 and 2 into step 2's all_reduce (asked again, within rank 1's
        # 8 s, while a loaded machine has not yet brought them there)
        asked = 0
        for _ in range(10):
            time.sleep(0.5)
            asked += 1
            r = distdebug("stacks", str(run), "--timeout", "5")
            assert r.returncode == 0, r.output
            head = r.stdout.splitlines()[0]
            groups = dict(part.split(": ", 1) for part in head.split(" | "))
            if set(groups) == {"ranks 0, 2", "rank 1"}:
                break
        assert set(groups) == {"ranks 0, 2", "rank 1"}, head
        assert groups["rank 1"].startswith("at handwritten_allreduce.py:") and "time.sleep(args.sleep)" in groups[
            "rank 1"], head
        assert groups["ranks 0, 2"].startswith("in all_reduce (torch.distributed) at handwritten_allreduce.py:"), head
        assert "dist.all_reduce(prm.grad)" in groups["ranks 0, 2"], head
        assert "inside all_reduce" in r.stdout  # the collective each waiting rank is in, from its progress record
        # Woken by their node's relay (runtime.wake): a rank looked at the request file once at its start and once
        # a request, never in between (O(nodes) file system operations a second, not O(ranks)).
        for rank in range(3):
            answer = json.loads(layout.stacks_answer_path(run, rank).read_text())
            assert answer["woken"] and answer["request_checks"] <= 1 + asked, answer["request_checks"]
        if shutil.which("py-spy") is None:
            assert "native frames: py-spy is not installed" in r.stdout
        else:  # a test extra: the C++ wait the collective sits in, and the sleep's
            waiting, asleep = r.stdout.split("\n== rank 1:")
            assert "native (py-spy dump --native) of rank 0, one of 2:" in waiting, r.stdout
            assert "c10d::Work::wait" in waiting and "time_sleep" in asleep, r.stdout
        # every rank answered from its watchdog thread: the job was not stopped, and finishes by itself
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert [s["step"] for s in kinds(run, 1, "step")] == [1, 2, 3]
        assert [f for r in range(3) for f in kinds(run, r, "finding") if f["severity"] != "info"] == []
    finally:
        kill_tree(proc.pid)


def test_a_status_line_on_a_terminal_and_top_from_another_while_it_runs_and_after(tmp_path):
    """attach on a terminal (a pseudo-terminal here): one status line for the node, refreshed; `distdebug
    top --json` from outside while it runs (every rank, its step, running); `distdebug top` after it ended:
    the final state; and no status line when attach's output is not a terminal, whose finished run `distdebug
    stacks` answers in one clear line."""
    import json
    import os
    import pty
    import select

    run = tmp_path / "run"
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "attach", "--run-dir", str(run), SCRIPT,
                             "--steps", "16", "--sleep", "0.25"], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, env=make_env(), cwd=ROOT, start_new_session=True)
    os.close(slave)
    out, seen_running = b"", None
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the terminal's other end closed: the launcher is gone
                    break
                if not chunk:
                    break
                out += chunk
            if seen_running is None and all(
                    layout.events_path(run, r).exists() and len(kinds(run, r, "step")) >= 3 for r in (0, 1)):
                seen_running = json.loads(distdebug("top", "--json", str(run)).stdout)
        proc.wait(timeout=60)
    finally:
        os.close(master)
        kill_tree(proc.pid)
    assert proc.returncode == 0
    text = out.decode(errors="replace")
    assert "distdebug: node 0 | step " in text and " steps/s | loss " in text and "| findings 0" in text, text[-3000:]
    assert seen_running is not None and seen_running["running"], seen_running
    assert [r["rank"] for r in seen_running["ranks"]] == [0, 1]
    assert all(r["step"] >= 3 and r["status"] == "running" for r in seen_running["ranks"]), seen_running
    final = distdebug("top", str(run))
    assert final.returncode == 0, final.output
    assert "distdebug top (2 ranks, ended)" in final.stdout and final.stdout.count("exited 0") == 2, final.stdout
    piped = distdebug("attach", "--run-dir", str(tmp_path / "piped"), SCRIPT, "--steps", "4", "--sleep", "1.2")
    assert piped.returncode == 0 and "steps/s" not in piped.output
    # stacks of a finished run: one clear line
    r = distdebug("stacks", str(tmp_path / "piped"))
    assert r.returncode == 1, r.output
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("distdebug: error: no rank of ") and "'distdebug report' reads a finished one" in line

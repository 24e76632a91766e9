"""Tier 3 (end to end): the log-volume guard on a real job (issue 48, item 6). The job's output file lies on a
small file system that its prints would fill within the job's expected length, its run directory on a disk
with room: one warning, naming the small file system, the output file and the fix, and none for the disk (the
twin inside the same job). Then the guard's prediction (the bytes an hour measured over its window after the
first steps) is set beside what the job then wrote, destination by destination: within 20 %.

Needs: 2 ranks, a paced loop (a step every 40 ms, whatever the load: its output grows at a steady rate) that
prints 1,000 bytes a step a rank (50 KB/s: about 170 MiB an hour into a 4 MiB tmpfs), 12 s of steps, the
guard's window shortened to 3 s (DISTDEBUG_VOLUME_WINDOW_S).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from distdebug.artifacts import layout
from distdebug.artifacts.reader import read_events
from tests.helpers import DATA, ROOT, distdebug, small_fs

CHATTY = DATA / "scripts" / "chatty.py"
"""Prints 1,000 bytes a step a rank, paced (shared with docs/gen.py's log-volume example)."""


def test_a_job_whose_output_would_fill_its_file_system_is_warned_with_the_numbers(tmp_path):
    script = CHATTY  # prints 1,000 bytes a step a rank: 300 steps, one every 40 ms
    run_dir = tmp_path / "run"
    env = {**os.environ, "DISTDEBUG_VOLUME_WINDOW_S": "3", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    with small_fs(tmp_path / "fs", 4096) as fs:
        out = fs / "job.out"
        with open(out, "wb") as stdout, open(tmp_path / "job.err", "wb") as stderr:
            r = subprocess.run([sys.executable, str(ROOT / "cli.py"), "attach", "--run-dir", str(run_dir),
                                "--expected-hours", "24", str(script), "300", "0.04", "1000"],
                               stdout=stdout, stderr=stderr, env=env, timeout=180)
        err = (tmp_path / "job.err").read_text()
        assert r.returncode == 0, err[-3000:]
        assert out.stat().st_size == 2 * 300 * 1000  # the job's output, whole
        findings, _ = read_events(layout.run_findings_path(run_dir))
        (f,) = [x for x in findings if x.get("detector") == "log_volume"]
        assert f["subject"] == str(fs) and f["ranks"] == [0, 1] and f["step"] >= 2 and f["severity"] == "warning"
        assert f"stdout ({out})" in f["message"] and "expected to run" in f["message"] and "(--expected-hours)" in f[
            "message"]
        assert "print less often" in f["fix"]
        assert 0 < f["evidence"]["hours_to_fill"] < 1 and f["evidence"]["hours_left"] > 23
        assert "log_volume" in err and str(fs) in err  # said when found, on the launcher's stderr

        (node,) = [json.loads(p.read_text()) for _, p in layout.node_files(run_dir)]
        volume = node["volume"]
        assert volume["measured"] and volume["warned"] == [str(fs)]  # the disk with the run directory: not
        rates = {d["key"]: (d["predicted_bytes_per_hour"], d["written_bytes_per_hour"])
                 for d in volume["destinations"]}
        for key in ("stdout", "run"):
            predicted, written = rates[key]
            assert written > 0 and abs(predicted - written) <= 0.2 * written, (key, rates, volume)
        assert abs(rates["stdout"][1] - 2 * 1000 * 25 * 3600) <= 0.2 * 2 * 1000 * 25 * 3600

        report = distdebug("report", str(run_dir))
        assert report.returncode == 0, report.output[-3000:]
        assert "disk: node 0: measured over" in report.stdout and "log_volume" in report.stdout

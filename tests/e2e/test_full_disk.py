"""Tier 3 (end to end): a whole job whose run directory's file system fills up in the middle of the training
(a real tmpfs of a few hundred KiB, mounted by the test and unmounted after it), beside its clean twin on a disk
with room. The training is untouched (bitwise the same parameters, exit 0), each rank says once that its writes
failed and keeps its findings and its end record, what was written reads back, and the report says from which
step the records stop and why, instead of taking the silent ranks for killed ones.

Needs: 2 ranks (each writer fills and degrades on its own), manual_allreduce.py for 150 steps (about 60 KiB of
records a rank: enough to fill what is left), 200 KiB left free after the filler (the launcher's files and the
ranks' reserves fit; the per-step records do not).
"""

from __future__ import annotations

import json

from distdebug.artifacts import layout, schema
from distdebug.artifacts.reader import read_events
from tests.helpers import RECIPES, distdebug, fill, read_digests, small_fs

STEPS = "150"
FAILED = "writing the run directory failed"


def test_a_run_directory_that_fills_mid_run_never_harms_the_training(tmp_path):
    script = str(RECIPES / "manual_allreduce.py")
    twin = distdebug("attach", "--run-dir", str(tmp_path / "twin"), script, "--steps", STEPS,
                     "--digest-out", str(tmp_path / "twin-digests"))
    assert twin.returncode == 0 and FAILED not in twin.stderr, twin.output[-3000:]
    with small_fs(tmp_path / "fs", 1024) as fs:
        fill(fs, leave_kb=200)
        run_dir = fs / "run"
        r = distdebug("attach", "--run-dir", str(run_dir), script, "--steps", STEPS,
                      "--digest-out", str(tmp_path / "full-digests"))
        assert r.returncode == 0, r.output[-3000:]  # the training's own exit code
        said = [line for line in r.stderr.splitlines() if FAILED in line]
        assert sorted(line.split(":")[1].strip() for line in said) == ["rank 0", "rank 1"], r.stderr[-3000:]
        assert all("ENOSPC" in line for line in said)
        for rank in (0, 1):
            records, _ = read_events(layout.events_path(run_dir, rank))
            kinds = [x["kind"] for x in records]
            (failed,) = [x for x in records if x["kind"] == schema.WRITE_FAILED]
            steps = [x["step"] for x in records if x["kind"] == schema.STEP]
            assert steps == list(range(1, len(steps) + 1)) and 1 < len(steps) < int(STEPS)
            assert failed["step"] >= steps[-1] and kinds[-1] == schema.END and kinds[0] == schema.START
            assert not layout.reserve_path(layout.events_path(run_dir, rank)).exists()
        report = distdebug("report", "--json", str(run_dir))
        assert report.returncode == 0, report.output[-3000:]
        ranks = json.loads(report.stdout)["ranks"]
        assert [x["status"].split(";")[0] for x in ranks] == ["exit 0", "exit 0"]
        assert all("its writes failed from step" in x["status"] and "ENOSPC" in x["status"] for x in ranks)
    assert read_digests(tmp_path / "full-digests") == read_digests(tmp_path / "twin-digests")  # bitwise
    twin_report = json.loads(distdebug("report", "--json", str(tmp_path / "twin")).stdout)
    assert [x["status"] for x in twin_report["ranks"]] == ["exit 0", "exit 0"]

"""Tier 3 (end to end): a real job of thousands of steps under the smallest run-directory budget (issue 48,
item 1). Each rank's part of the run directory stays within the budget while it runs and after, whatever the
job's length (here ~40 rotations of the events and ~8 of the fingerprints); the report reads the thinned
stream (its first and last steps, every step accounted for, what was thinned said), and diff tells what a
thinned step can still tell. The tiers themselves are tested on the writers (tests/unit/test_retention.py);
this proves the wiring: attach's option, the ranks' writers, the detectors' pins, the readers.

Needs: 2 ranks (the offline cross-rank diff of thinned steps), ddp_convnet.py for 1,500 steps (about 16 s of
steps; its 8 fingerprinted tensors fill a fingerprint segment of the 512K budget every ~240 steps, so it takes
~1,200 steps before a segment leaves the ring and is thinned to digests), the smallest budget (512K).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from distdebug.artifacts import layout, schema
from distdebug.artifacts.reader import load_rank, read_stream
from tests.helpers import RECIPES, distdebug, make_env

STEPS = 1500
BUDGET = 512 << 10


def rank_bytes(run_dir: Path) -> dict[int, int]:
    out = {}
    for rank, folder in layout.rank_dirs(run_dir):
        total = 0
        for f in list(folder.iterdir()) if folder.exists() else []:
            try:
                total += f.stat().st_size
            except OSError:  # rotated or thinned between the listing and the stat
                pass
        out[rank] = total
    return out


def test_a_long_job_stays_within_its_run_directory_budget(tmp_path):
    run_dir = tmp_path / "run"
    most: dict[int, int] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            for rank, size in rank_bytes(run_dir).items():
                most[rank] = max(most.get(rank, 0), size)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        r = distdebug("attach", "--run-dir", str(run_dir), "--run-dir-budget", "512K",
                      str(RECIPES / "ddp_convnet.py"), "--steps", str(STEPS), timeout=300,
                      env=make_env(DISTDEBUG_VOLUME_WINDOW_S="2"))
    finally:
        done.set()
        watcher.join()
    assert r.returncode == 0, r.output[-3000:]
    assert sorted(most) == [0, 1] and max(most.values()) <= BUDGET, most  # while it ran (the reserve included)
    assert max(rank_bytes(run_dir).values()) <= BUDGET
    for rank in (0, 1):
        live = layout.events_path(run_dir, rank)
        assert len(layout.segments(live)) == 4 and layout.thinned_path(live).exists()  # head + ring: bounded
        records, damaged = read_stream(live)
        assert damaged == 0 and records[0]["kind"] == schema.START and records[-1]["kind"] == schema.END
        whole = [x["step"] for x in records if x["kind"] == schema.STEP]
        thinned = [x for x in records if x["kind"] == schema.STEPS_THINNED]
        assert whole[0] == 1 and whole[-1] == STEPS  # the first and the last steps
        assert len(whole) + sum(x["steps"] for x in thinned) == STEPS  # every step accounted for, once
        assert (layout.rank_dir(run_dir, rank) / layout.FINGERPRINT_ROOTS).stat().st_size
        # Read through its index (issue 48, reading at scale): the records but the per-step ones, as whole; the
        # per-step figures of every step written, which the thinned stream no longer has whole.
        indexed = load_rank(rank, live.parent)
        first_loss = next(x["loss"] for x in records if x["kind"] == schema.STEP)  # step 1: the head, kept whole
        assert indexed.indexed and indexed.digest.last_step == STEPS and indexed.digest.first_loss == first_loss
        assert [x for x in indexed.records if x["kind"] not in schema.BULK] == \
            [x for x in records if x["kind"] not in schema.BULK and x["kind"] != schema.STEPS_THINNED]
    # the log-volume guard's clean twin (tests/e2e/test_volume.py): it measured, and a run directory bounded
    # by its budget fills nothing however long the job (its output a pipe: nothing else to measure)
    (node,) = [json.loads(p.read_text()) for _, p in layout.node_files(run_dir)]
    assert node["volume"]["measured"] and node["volume"]["warned"] == [], node["volume"]
    assert [d["key"] for d in node["volume"]["destinations"]] == ["run"]
    assert all(fs["hours_to_fill"] is None for fs in node["volume"]["file_systems"].values())
    report = distdebug("report", "--json", str(run_dir))
    assert report.returncode == 0, report.output[-3000:]
    summary = json.loads(report.stdout)
    assert not [f for f in summary["findings"] if f["detector"] == "log_volume"]
    assert [x["steps"] for x in summary["ranks"]] == [STEPS, STEPS]
    assert summary["thinned"] and all("summaries" in x and "one digest each" in x for x in summary["thinned"])
    said = summary["thinned"][0]
    text = distdebug("report", str(run_dir))
    assert "thinned by the run-directory budget" in text.stdout
    first = json.loads(distdebug("diff", "--json", str(run_dir)).stdout)
    assert first["identical"] and first["checked_steps"].startswith("1..")
    at = int(said.split("fingerprints of steps ")[1].split("-")[0].replace(",", ""))
    thinned_step = json.loads(distdebug("diff", "--json", str(run_dir), "--step", str(at)).stdout)
    assert thinned_step["thinned"] and thinned_step["identical"]

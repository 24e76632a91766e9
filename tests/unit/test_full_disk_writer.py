"""Tier 1 (no ranks; a real tmpfs of a few hundred KiB, mounted and unmounted by the test): a rank's event
writer on a disk that fills. It never raises, says so once, writes a ``write_failed`` record, keeps writing the
essential records (findings, stalls, the end) out of the space it held back, drops the per-step bulk, and every
line it wrote reads back; the fingerprint writer stops at a whole record. The clean twin: the same writes on a
disk with room give no failure and no reserve left behind. The whole job on a full disk: tests/e2e/test_full_disk.py."""

from __future__ import annotations

import contextlib
import io

import numpy as np

from distdebug.artifacts import layout, schema
from distdebug.artifacts.reader import load_rank, read_events
from distdebug.artifacts.writer import RESERVE, EventWriter
from distdebug.fingerprint.snapshots import SnapshotWriter, parse_records
from tests.helpers import fill, small_fs

STEP_PAD = "x" * 400  # a step record about the size of a real one


def _steps(w: EventWriter, first: int, n: int) -> None:
    for step in range(first, first + n):
        w.write(schema.record(schema.STEP, rank=0, step=step, loss=1.0, pad=STEP_PAD))


def test_a_full_disk_keeps_the_essential_records_says_so_once_and_reads_back(tmp_path, monkeypatch):
    from distdebug.artifacts import writer

    monkeypatch.setattr(writer, "INDEX_EVERY", 8)  # the index saved a few times before the disk fills
    with small_fs(tmp_path / "fs", 512) as fs:
        path = fs / "rank-00000" / layout.EVENTS
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            w = EventWriter(path, reserve=RESERVE, label="rank 0", index=True)  # as a rank's (bootstrap)
            assert layout.reserve_path(path).stat().st_size == RESERVE
            fill(fs, leave_kb=24)
            w.write(schema.record(schema.START, rank=0))
            _steps(w, 1, 200)  # about 90 KiB: the disk fills on the way
            assert w.degraded
            w.write(schema.record(schema.FINDING, rank=0, step=201, detector="nan_origin", subject="w"))
            _steps(w, 202, 50)
            w.write(schema.record(schema.STALL, rank=0, step=252, idle_s=5.0))
            w.write(schema.record(schema.END, rank=0, exit_code=0, steps=252, write_errors=w.failed_writes))
            w.close()
        lines = [x for x in err.getvalue().splitlines() if "writing the run directory failed" in x]
        assert len(lines) == 1 and "ENOSPC" in lines[0] and lines[0].startswith("distdebug: rank 0:"), err.getvalue()
        records, damaged = read_events(path)
        kinds = [r["kind"] for r in records]
        (failed,) = [r for r in records if r["kind"] == schema.WRITE_FAILED]
        assert failed["error"].startswith("ENOSPC") and failed["lost"] == schema.STEP
        steps = [r["step"] for r in records if r["kind"] == schema.STEP]
        assert steps == list(range(1, failed["step"]))  # every step before the first lost one, none after
        assert kinds[-3:] == [schema.FINDING, schema.STALL, schema.END]  # out of the space held back
        assert damaged <= 1  # at most the one record the disk cut
        assert not layout.reserve_path(path).exists()  # given back at the end
        # Its index stopped where the disk refused it (never wrong): read through it, the same records but the
        # per-step ones (in its digest: the same last step).
        assert w.indexer is not None and not w.indexer.on
        fast = load_rank(0, path.parent)
        assert fast.indexed and fast.damaged_lines == damaged
        assert [r for r in fast.records if r["kind"] != schema.STEP] == [r for r in records if r["kind"] != schema.STEP]
        assert fast.digest.last_step == steps[-1]


def test_the_clean_twin_writes_everything_and_leaves_no_reserve(tmp_path):
    with small_fs(tmp_path / "fs", 512) as fs:
        path = fs / "rank-00000" / layout.EVENTS
        w = EventWriter(path, reserve=RESERVE, label="rank 0")
        _steps(w, 1, 200)
        w.close()
        records, damaged = read_events(path)
        assert [r["step"] for r in records] == list(range(1, 201)) and damaged == 0 and w.failed_writes == 0
        assert not w.degraded and not layout.reserve_path(path).exists()


def test_fingerprint_snapshots_stop_at_a_whole_record_on_a_full_disk(tmp_path):
    with small_fs(tmp_path / "fs", 256) as fs:
        w = SnapshotWriter(fs / "rank-00000")
        fps = {f"layer{i}.weight": i * 7919 for i in range(100)}  # 816 bytes a step
        w.write(1, fps)
        fill(fs, leave_kb=8)
        for step in range(2, 40):
            w.write(step, fps)
        assert w.stopped is not None and w.stopped[1].startswith("ENOSPC")
        w.close()
        import json

        lists = json.loads(w.names_path.read_text())["names"]
        got = parse_records((fs / "rank-00000" / layout.FINGERPRINTS).read_bytes(), lists)
        assert sorted(got) == list(range(1, w.stopped[0]))  # every step before it, whole
        assert np.array_equal(got[1][1], np.array(list(fps.values()), dtype=np.uint64))


def test_many_findings_never_use_up_the_room_of_a_stall_and_the_end(tmp_path):
    """A long degraded run that keeps finding (or warning of busy stalls): the findings take the reserve down
    to its last part, which only a stall and the end record may take."""
    with small_fs(tmp_path / "fs", 512) as fs:
        path = fs / "rank-00000" / layout.EVENTS
        with contextlib.redirect_stderr(io.StringIO()):
            w = EventWriter(path, reserve=RESERVE, label="rank 0")
            fill(fs, leave_kb=8)
            _steps(w, 1, 40)
            assert w.degraded
            for i in range(400):  # about 200 KiB of findings: far more than the reserve
                w.write(schema.record(schema.FINDING, rank=0, step=41, detector="loss_spike", subject=str(i),
                                      message="m" * 400))
            w.write(schema.record(schema.STALL, rank=0, step=41, idle_s=5.0, main_stack=[{"code": "x" * 2000}]))
            w.write(schema.record(schema.END, rank=0, exit_code=0, steps=41))
            w.close()
        records, _ = read_events(path)
        kinds = [r["kind"] for r in records]
        assert kinds[-2:] == [schema.STALL, schema.END] and 20 < kinds.count(schema.FINDING) < 400


def test_the_profilers_stderr_spool_needs_no_temporary_folder(tmp_path, capfd, monkeypatch):
    # While torch's profiler starts or stops, fd 2 goes to a spool; with $TMPDIR full (a real tmpfs, filled),
    # the script's own writes to stderr in that moment must still succeed and reach the real stderr.
    import os
    import tempfile

    from distdebug.detectors import profiler
    from tests.helpers import fill, small_fs

    with small_fs(tmp_path / "tmp", 64) as full:
        fill(full, leave_kb=0)

        class FullTmp:
            @staticmethod
            def TemporaryFile():  # noqa: N802 (tempfile's name)
                return tempfile.TemporaryFile(dir=full)

        monkeypatch.setattr(profiler, "tempfile", FullTmp)
        with profiler._without_profiler_chatter():
            os.write(2, b"the script's own line, " + b"x" * 8192 + b"\n")
    assert "the script's own line" in capfd.readouterr().err

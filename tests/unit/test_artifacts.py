"""Tier 1 (pure, no processes): run-dir layout, append-only writer, tolerant reader, run resolution."""

from __future__ import annotations

import json
import os
import time

import pytest

from distdebug.artifacts import layout, runs, schema
from distdebug.artifacts.reader import load_run, read_events
from distdebug.artifacts.writer import EventWriter
from distdebug.errors import UserError


def test_writer_appends_and_reader_skips_cut_last_line(tmp_path):
    path = layout.events_path(tmp_path, 3)
    w = EventWriter(path)
    w.write(schema.record(schema.START, rank=3))
    w.write(schema.record(schema.STEP, rank=3, step=1, loss=float("nan")))
    w.close()
    # A second writer (an elastic restart) appends; it never truncates.
    w2 = EventWriter(path)
    w2.write(schema.record(schema.STEP, rank=3, step=2, loss=1.5))
    w2.close()
    with open(path, "ab") as f:
        f.write(b'{"v":1,"kind":"step","rank":3,"st')  # what a SIGKILL mid-write could leave
    records, damaged = read_events(path)
    assert [r["kind"] for r in records] == ["start", "step", "step"]
    assert records[1]["loss"] != records[1]["loss"]  # NaN survives the round trip
    assert damaged == 1


def test_what_is_written_is_strict_json_and_non_finite_numbers_come_back(tmp_path):
    """A record with NaN and Infinity in it (a loss, a norm, nested in evidence) is written as strict JSON, which
    a browser's or jq's parser reads ("NaN", "Infinity", "-Infinity" as strings: issue 63), and read back by
    distdebug as the numbers; a document without one is json's own text; other errors of json stay errors."""
    import math

    from distdebug import strictjson

    path = layout.events_path(tmp_path, 0)
    w = EventWriter(path)
    w.write(schema.record(schema.STEP, rank=0, step=1, loss=math.nan, grad_norm=math.inf,
                          evidence={"norms": [1.0, -math.inf], "name": "w"}))
    w.close()
    line = path.read_text().splitlines()[0]
    raw = strictjson.strict_loads(line)
    assert (raw["loss"], raw["grad_norm"], raw["evidence"]["norms"]) == ("NaN", "Infinity", [1.0, "-Infinity"])
    [rec], _ = read_events(path)
    assert math.isnan(rec["loss"]) and rec["grad_norm"] == math.inf and rec["evidence"]["norms"] == [1.0, -math.inf]
    assert rec["evidence"]["name"] == "w"
    plain = {"a": [1, 2.5, "x"], "b": None}
    assert strictjson.dumps(plain, separators=(",", ":")) == json.dumps(plain, separators=(",", ":"))
    assert strictjson.loads(json.dumps({"x": math.nan}))["x"] != 0  # Python's bare NaN is still read
    with pytest.raises(ValueError, match="not JSON"):
        strictjson.strict_loads(json.dumps({"x": math.nan}))
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular"):
        strictjson.dumps(loop)

    class Odd:  # what default= turns into text keeps working, a NaN beside it too
        def __str__(self) -> str:
            return "odd"

    assert strictjson.strict_loads(strictjson.dumps({"o": Odd(), "n": math.nan}, default=str)) == {"o": "odd",
                                                                                                   "n": "NaN"}


def test_reader_rejects_newer_schema_and_garbage(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text('{"v":1,"kind":"start"}\nnot json\n{"v":99,"kind":"step"}\n')
    records, damaged = read_events(path)
    assert len(records) == 1 and damaged == 2


def test_load_run_and_rank_dir_names(tmp_path):
    for rank in (0, 12):
        w = EventWriter(layout.events_path(tmp_path, rank))
        w.write(schema.record(schema.START, rank=rank))
        w.close()
    (tmp_path / "rank-junk").mkdir()
    (tmp_path / layout.MANIFEST).write_text(json.dumps({"v": 1, "command": ["x"]}))
    run = load_run(tmp_path)
    assert sorted(run.ranks) == [0, 12]
    assert run.manifest == {"v": 1, "command": ["x"]}
    assert layout.rank_of_dir("rank-00012") == 12 and layout.rank_of_dir("rank-x") is None


def test_new_run_dir_is_unique_and_latest_resolves(tmp_path):
    root = tmp_path / layout.DEFAULT_RUNS_ROOT
    a = runs.prepare_run_dir(runs.new_run_dir("train", root))
    b = runs.prepare_run_dir(runs.new_run_dir("train", root))
    assert a != b
    runs.mark_latest(a)
    assert runs.resolve_run(None, cwd=tmp_path) == a
    runs.mark_latest(b)
    assert runs.resolve_run(None, cwd=tmp_path) == b
    assert runs.resolve_run(b.name, cwd=tmp_path) == b
    assert runs.resolve_run(str(a), cwd=tmp_path) == a


def test_new_run_dirs_asked_for_side_by_side_are_each_their_own(tmp_path):
    """Two launches (or replays) in the same second on one machine must not share a directory: each
    name is claimed by creating it."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path / layout.DEFAULT_RUNS_ROOT
    with ThreadPoolExecutor(8) as pool:
        dirs = list(pool.map(lambda _: runs.new_run_dir("faults", root), range(16)))
    assert len(set(dirs)) == 16 and all(d.is_dir() for d in dirs)


def test_newest_without_latest_link_uses_mtime(tmp_path):
    root = tmp_path / layout.DEFAULT_RUNS_ROOT
    old, new = root / "old", root / "new"
    old.mkdir(parents=True)
    new.mkdir()
    os.utime(old, (time.time() - 100, time.time() - 100))
    assert runs.resolve_run(None, cwd=tmp_path) == new.resolve()


def test_missing_runs_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="no runs under"):
        runs.resolve_run(None, cwd=tmp_path)
    with pytest.raises(UserError, match="no run directory 'nope'"):
        runs.resolve_run("nope", cwd=tmp_path)


def test_unwritable_run_dir_is_a_user_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="cannot write the run directory"):
        runs.prepare_run_dir(blocker / "run")


def test_launchers_preparing_one_run_directory_at_once_do_not_trip_each_other(tmp_path):
    # Two nodes' launchers on one host share --run-dir (the two-node test does): each probes the
    # directory with a file of its own; a shared probe name let one unlink the other's (a one-line
    # "cannot write the run directory" error, and the other node waited for it forever).
    import multiprocessing as mp

    from distdebug.artifacts.runs import prepare_run_dir

    def hammer(path, errors):
        try:
            for _ in range(300):
                prepare_run_dir(path)
        except Exception as e:  # noqa: BLE001  (any failure is the finding)
            errors.put(repr(e))

    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    procs = [ctx.Process(target=hammer, args=(tmp_path / "run", errors)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert errors.empty()

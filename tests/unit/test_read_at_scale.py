"""Tier 1: reading at scale (issue 48, item 4). The real writers keep, beside each rank's streams, what a reader
at scale reads instead of every line: the event stream's index (essential records and a digest of the
per-step ones, artifacts.digest) and the fingerprint blocks (fingerprint.snapshots.BlockWriter). Each test sets
the read through them beside the stream read whole, on the same files, and requires the same answer: a
clean run and a faulty twin, a rank killed before its index caught up, a restarted rank, a budget that
thinned, a stream the index no longer matches (read whole: never a wrong answer, only a slower one)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from distdebug.analysis import diff
from distdebug.analysis.summary import summarize
from distdebug.artifacts import digest, layout, retention, schema
from distdebug.artifacts.reader import RankStream, load_rank, load_run, read_stream
from distdebug.artifacts.writer import INDEX_EVERY, EventWriter
from distdebug.fingerprint.snapshots import BLOCK, SnapshotWriter, read_blocks_file


def step(rank: int, n: int, attempt: int = 0) -> dict:
    return schema.record(schema.STEP, rank=rank, step=n, attempt=attempt, time=1000.0 + n,
                         loss=2.0 + ((n * 7919) % 113) / 100.0, step_time_s=0.010 + (n * 31 % 17) * 0.001,
                         backward_calls=1, collectives=3 + (n % 2))


def records(rank: int, steps: range, attempt: int = 0, end: bool = True) -> list[dict]:
    out = [schema.record(schema.START, rank=rank, attempt=attempt, world_size=2, node=0, host="h"),
           schema.record(schema.DISCOVERY, rank=rank, models=[{"wrapper": "ddp"}])]
    for n in steps:
        out.append(step(rank, n, attempt))
        if n % 97 == 0:
            out.append(schema.record(schema.MEMORY, rank=rank, step=n, total=1000 + n % 1000))
        if n % 50 == 0:
            out.append(schema.record(schema.HARNESS_COST, rank=rank, steps=n, training_thread_ms={"session": n / 10}))
        if n % 1234 == 0:
            out.append(schema.record(schema.FINDING, rank=rank, step=n, detector="loss_spike", subject="loss",
                                     severity="warning", message=f"a spike at {n}", ranks=[rank]))
    if end:
        out.append(schema.record(schema.END, rank=rank, exit_code=0, steps=steps[-1]))
    return out


def write(run: Path, rank: int, recs: list[dict], share: retention.Share | None, index: bool = True,
          close: bool = True) -> EventWriter:
    w = EventWriter(layout.events_path(run, rank), share=share, index=index)
    for r in recs:
        w.write(r)
    if w.thinner is not None:
        w.thinner.settle()
    if close:
        w.close()
    return w


def kill(w: EventWriter | SnapshotWriter) -> None:
    """The writer of a killed rank: nothing more of it (its thinning thread ended, as the process's would be)."""
    os.close(w._fd)  # noqa: SLF001
    if w.thinner is not None:
        w.thinner.stop(5.0)


def whole(run: Path, rank: int) -> RankStream:
    recs, damaged = read_stream(layout.events_path(run, rank))
    return RankStream(rank, recs, damaged)


def figures(stream: RankStream) -> dict:
    d = stream.digest
    return {"last_step": d.last_step, "first_loss": d.first_loss, "last_loss": d.last_loss,
            "median": d.median_step_time_s(), "work": d.work_median_ms(), "memory": d.memory_max,
            "cost": d.harness_cost, "curve": d.curve.to_json(),
            "essential": [r for r in stream.records if r.get("kind") not in schema.BULK],
            "last_steps": [r["step"] for r in stream.last_attempt() if r.get("kind") == schema.STEP][-5:]}


def test_a_short_run_reads_the_same_through_its_index_as_whole(tmp_path):
    """Under EXACT steps every figure is exact, so the index's and the whole stream's are equal, and the
    report's summary of the run too."""
    for rank in (0, 1):
        write(tmp_path, rank, records(rank, range(1, 201)), None)
    indexed = load_rank(0, layout.rank_dir(tmp_path, 0))
    assert indexed.indexed and figures(indexed) == figures(whole(tmp_path, 0))
    fast = summarize(load_run(tmp_path)).to_dict()
    for rank in (0, 1):  # the same directory without its indexes: read whole
        layout.index_path(layout.events_path(tmp_path, rank)).unlink()
    slow = summarize(load_run(tmp_path)).to_dict()
    assert fast == slow and fast["ranks"][0]["steps"] == 200


def test_a_long_thinned_run_reads_its_index_and_the_tail_only(tmp_path):
    """20,000 steps in a 256 KiB share: the index read gives the figures of every step written (the whole
    stream, thinned, no longer can), and reads nothing of the middle: garbage written over the thinned file
    and the head's middle is not seen."""
    share = retention.Share(256 << 10)
    plain = tmp_path / "plain"
    recs = records(0, range(1, 20001))
    write(tmp_path, 0, recs, share)
    write(plain, 0, recs, None, index=False)  # the same records kept whole: the truth
    truth = figures(whole(plain, 0))
    got = load_rank(0, layout.rank_dir(tmp_path, 0))
    assert got.indexed
    mine = figures(got)
    for k in ("last_step", "first_loss", "last_loss", "memory", "cost", "curve", "essential", "last_steps", "work"):
        assert mine[k] == truth[k], k
    assert abs(mine["median"] / truth["median"] - 1) < 1e-3
    assert [r["step"] for r in mine["essential"] if r["kind"] == schema.FINDING] == list(range(1234, 20001, 1234))
    thinned = layout.thinned_path(layout.events_path(tmp_path, 0))
    assert thinned.exists()
    with open(thinned, "r+b") as f:  # the thinned file becomes unreadable: the index read never looks at it
        f.write(b"\x00garbage\n" * (thinned.stat().st_size // 9))
    again = load_rank(0, layout.rank_dir(tmp_path, 0))
    assert again.indexed and again.damaged_lines == 0 and figures(again) == mine


def test_a_killed_rank_is_read_through_its_index_and_what_followed(tmp_path):
    """A rank killed between two saves: the index is behind by up to INDEX_EVERY records; the reader reads them
    from the stream and the figures are those of everything written."""
    share = retention.Share(256 << 10)
    recs = records(0, range(1, 3001), end=False)[:-(INDEX_EVERY // 2)]
    w = write(tmp_path, 0, recs, share, close=False)
    plain = tmp_path / "plain"
    write(plain, 0, recs, None, index=False)
    got = load_rank(0, layout.rank_dir(tmp_path, 0))
    truth = figures(whole(plain, 0))
    assert got.indexed
    for k in ("last_step", "last_loss", "essential", "last_steps", "curve", "cost"):
        assert figures(got)[k] == truth[k], k
    kill(w)


def test_a_restarted_rank_goes_on_with_its_index(tmp_path):
    """An elastic restart: a new writer on the same stream (the old one killed, its index behind) takes the
    index up from what the stream holds; the last attempt's figures and every record read as whole."""
    share = retention.Share(256 << 10)
    first = records(0, range(1, 2501), end=False)
    second = records(0, range(2001, 4001), attempt=1)
    w = write(tmp_path, 0, first, share, close=False)
    kill(w)
    write(tmp_path, 0, second, share)
    plain = tmp_path / "plain"
    write(plain, 0, first + second, None, index=False)
    got, truth = load_rank(0, layout.rank_dir(tmp_path, 0)), whole(plain, 0)
    assert got.indexed
    for k in ("last_step", "first_loss", "last_loss", "essential", "last_steps", "curve", "cost", "work"):
        assert figures(got)[k] == figures(truth)[k], k
    assert summarize(load_run(tmp_path)).ranks[0].steps == 4000


def test_an_index_the_stream_no_longer_matches_is_not_used(tmp_path):
    """A segment the index's position needs is gone (deleted by hand, or thinned before a restarted rank's
    index caught up), or the live file is shorter than the position: read whole, never a wrong answer."""
    share = retention.Share(64 << 10)
    write(tmp_path, 0, records(0, range(1, 5001)), share)
    live = layout.events_path(tmp_path, 0)
    index = json.loads(layout.index_path(live).read_text())
    index["pos"]["next"] -= 5  # a position in a segment thinned since
    layout.index_path(live).write_text(json.dumps(index))
    assert not load_rank(0, live.parent).indexed
    index["pos"]["next"] += 5
    index["pos"]["offset"] = live.stat().st_size + 100
    layout.index_path(live).write_text(json.dumps(index))
    assert not load_rank(0, live.parent).indexed
    layout.index_path(live).write_text("{not json")
    assert not load_rank(0, live.parent).indexed


def test_the_essential_file_past_its_part_stops_the_index_where_it_was_right(tmp_path):
    """A detector that finds every step: the essential file reaches its part of the budget, the index stops
    where it was last saved, and readers read the stream past it, or whole once the segment it points into was
    thinned (as here): slower, and the findings are there."""
    share = retention.Share(1 << 20)
    recs = [schema.record(schema.START, rank=0, attempt=0)]
    for n in range(1, 2001):
        recs += [step(0, n), schema.record(schema.FINDING, rank=0, step=n, detector="x", subject="s",
                                           severity="info", message="m" * 200, ranks=[0])]
    w = write(tmp_path, 0, recs, share)
    assert w.indexer is not None and not w.indexer.on
    assert layout.essential_path(layout.events_path(tmp_path, 0)).stat().st_size <= share.total / 8
    got = load_rank(0, layout.rank_dir(tmp_path, 0))
    assert not got.indexed and [r["step"] for r in got.records if r["kind"] == schema.FINDING][-1] == 2000


def test_a_hang_verdict_counts_every_steps_collectives_through_the_index(tmp_path):
    """A stuck rank's collectives entered since the start, less those of its completed steps, are the ones it
    is inside: the index keeps the last steps' records only, its digest the sum of all."""
    from distdebug.analysis.hang.load import rank_states

    recs = records(0, range(1, 3001), end=False)
    total = sum(r["collectives"] for r in recs if r["kind"] == schema.STEP)
    recs.append(schema.record(schema.STALL, rank=0, step=3001, phase="training", idle_s=60.0,
                              collectives_entered=total + 2))
    write(tmp_path, 0, recs, retention.Share(256 << 10))
    run = load_run(tmp_path)
    assert run.ranks[0].indexed
    st = rank_states(run)[0]
    assert len(st.step_collectives) < 3000 and st.in_progress_collectives == 2


def test_the_digest_is_bounded_whatever_the_steps():
    d = digest.Digest()
    for n in range(1, 300_001):
        d.feed({"kind": "step", "step": n, "loss": 1.0, "step_time_s": 0.01 * (1 + (n % 1000) / 1000)})
    body = json.dumps(d.to_json())
    assert len(body) < 64 << 10 and len(d.curve.buckets) <= digest.CURVE and d.times.values is None
    assert abs(d.median_step_time_s() / 0.015 - 1) < 2e-3
    assert digest.Digest.from_json(json.loads(body)).to_json() == d.to_json()


# ---------------------------------------------------------------- the fingerprint blocks
def fps(n: int, tensors: int = 12, odd: int | None = None) -> dict[str, int]:
    return {f"layer{i}.weight": (n * 1_000_003 + i + (7 if i == odd else 0)) for i in range(tensors)}


def write_fps(run: Path, ranks: int, steps: int, share: retention.Share | None,
              diverge: dict[int, tuple[int, int]], killed: int | None = None) -> None:
    """``diverge``: step -> (rank, tensor) that differs from there on; ``killed``: a rank never closed."""
    for rank in range(ranks):
        w = SnapshotWriter(layout.rank_dir(run, rank), share=share)
        odd = None
        for n in range(1, steps + 1):
            bad = diverge.get(n)
            if bad and bad[0] == rank:
                odd = bad[1]
            w.write(n, fps(n, odd=odd))
        if w.thinner is not None:
            w.thinner.settle()
        if rank != killed:
            w.close()
        else:
            kill(w)  # its open block never written
        (layout.rank_dir(run, rank) / layout.EVENTS).touch()
        (layout.rank_dir(run, rank) / layout.ESSENTIAL).touch()  # no findings: nothing pinned


def both(run: Path, monkeypatch: pytest.MonkeyPatch, at: int | None = None) -> tuple[dict, dict]:
    """diff's answer read whole and through the blocks."""
    monkeypatch.setattr(diff, "BLOCKS_FROM_BYTES", 1 << 62)
    slow = diff.rank_result(run, at)
    monkeypatch.setattr(diff, "BLOCKS_FROM_BYTES", 0)
    fast = diff.rank_result(run, at)
    assert "read" in fast and "read" not in slow
    return slow, fast


def same(slow: dict, fast: dict) -> None:
    for k in ("step", "identical", "thinned", "not_compared", "tensors", "ranks"):
        assert fast[k] == slow[k], (k, fast[k], slow[k])


@pytest.mark.parametrize("share", [None, retention.Share(512 << 10)], ids=["whole", "thinned"])
def test_blocks_find_the_rank_step_and_tensor_a_whole_read_finds(tmp_path, monkeypatch, share):
    """Five ranks, rank 3's tensor 5 departs at step 3,333 (a block's middle); a clean twin. Through the blocks
    only one rank per distinct block is read whole; the answer is the whole read's."""
    faulty, clean = tmp_path / "faulty", tmp_path / "clean"
    write_fps(faulty, 5, 6000, share, {3333: (3, 5)})
    write_fps(clean, 5, 6000, share, {})
    slow, fast = both(faulty, monkeypatch)
    same(slow, fast)
    assert fast["step"] == 3333 and fast["tensors"][0]["ranks"] == [3]
    assert fast["read"].endswith("2 rank(s) read whole")  # rank 0 for the four alike, and rank 3
    if share is None:
        assert fast["tensors"][0]["tensor"] == "layer5.weight" and fast["tensors"][0]["groups"] == [[0, 1, 2, 4], [3]]
    for at in (100, 3333, 5999):
        same(*both(faulty, monkeypatch, at))
    slow, fast = both(clean, monkeypatch)
    same(slow, fast)
    assert fast["identical"] and fast["checked_steps"] == "1..6000 (6000)"


def test_a_killed_ranks_last_steps_are_read_from_its_stream(tmp_path, monkeypatch):
    """Rank 1 killed: its open block was never written; the steps after its last block are read from its stream
    and a departure among them is found."""
    run = tmp_path / "run"
    write_fps(run, 3, 2 * BLOCK + 500, None, {2 * BLOCK + 300: (1, 2)}, killed=1)
    blocks = read_blocks_file(layout.rank_dir(run, 1) / layout.FINGERPRINT_BLOCKS)
    assert blocks[-1].last == 2 * BLOCK - 1  # steps 2048.. are in no block of rank 1
    slow, fast = both(run, monkeypatch)
    same(slow, fast)
    assert fast["step"] == 2 * BLOCK + 300 and fast["tensors"][0]["ranks"] == [1]


def test_blocks_past_their_cap_merge_and_still_find_it(tmp_path, monkeypatch):
    """A cap so small that blocks merge several times (the width doubles): the file stays within it and the
    departure is still found at its step."""
    from distdebug.fingerprint import snapshots

    monkeypatch.setattr(snapshots, "BLOCK", 64)  # the writers start at 64 steps a block: 625 of them to fit
    share = retention.Share(200 << 10)
    run = tmp_path / "run"
    write_fps(run, 3, 40_000, share, {31_111: (2, 0)})
    path = layout.rank_dir(run, 0) / layout.FINGERPRINT_BLOCKS
    blocks = read_blocks_file(path)
    assert blocks[0].width >= 256 and path.stat().st_size <= share.total // snapshots.BLOCKS_PART
    slow, fast = both(run, monkeypatch)
    same(slow, fast)
    # (so small a share halved the thinned steps' digests: the first step kept at or after 31,111 tells it)
    assert 31_111 <= fast["step"] < 31_111 + 512 and fast["tensors"][0]["ranks"] == [2]


def test_alternating_tensor_sets_keep_a_block_each_and_a_cap_merging_cannot_meet_stops_the_blocks(tmp_path,
                                                                                                    monkeypatch):
    """A detector that fingerprints two tensor sets by turns (a real run did: the blocks then flushed every step,
    and merging, which joins a set's blocks only, never met the cap: the width doubled until it overflowed).
    Each set keeps its own block; a cap merging cannot meet turns the blocks off, and diff reads the steps
    after them from the stream: the same answer."""
    from distdebug.fingerprint import snapshots

    run = tmp_path / "run"
    for rank in range(3):
        w = SnapshotWriter(layout.rank_dir(run, rank), share=None)
        for n in range(1, 3001):
            odd = 1 if (rank == 2 and n >= 2500 and n % 2) else None
            w.write(n, fps(n, tensors=6 if n % 2 else 9, odd=odd))
        w.close()
        (layout.rank_dir(run, rank) / layout.EVENTS).touch()
        (layout.rank_dir(run, rank) / layout.ESSENTIAL).touch()
        blocks = read_blocks_file(layout.rank_dir(run, rank) / layout.FINGERPRINT_BLOCKS)
        assert len(blocks) == 6 and {b.nid for b in blocks} == {0, 1} and max(b.last for b in blocks) == 3000
    slow, fast = both(run, monkeypatch)
    same(slow, fast)
    assert fast["step"] == 2501 and fast["tensors"][0]["ranks"] == [2]
    monkeypatch.setattr(snapshots, "BLOCK", 4)
    small = tmp_path / "small"
    w = SnapshotWriter(layout.rank_dir(small, 0), share=retention.Share(64 << 10))
    w.blocks.cap = 150  # below what one flush of the two sets takes: merging cannot meet it
    for n in range(1, 200):
        w.write(n, fps(n, tensors=6 if n % 2 else 9))
    assert not w.blocks.on and w.stopped is None  # the blocks off; the snapshots go on
    w.close()


def test_a_step_kept_whole_on_some_ranks_only_is_read_from_them(tmp_path, monkeypatch):
    """Pins are per rank (each rank's own findings): step 3,000 is thinned to a digest on rank 0 and kept whole
    on ranks 1 and 2, whose findings pinned it; rank 2 departs there. A class stands for its members only where
    they keep the block's steps in the same form, so the tensor is named as a whole read names it."""
    share = retention.Share(1 << 20)
    run = tmp_path / "run"
    for rank in range(3):
        w = SnapshotWriter(layout.rank_dir(run, rank), share=share)
        events = EventWriter(layout.events_path(run, rank), index=True)  # the rank's findings, as a rank writes them
        events.write(schema.record(schema.START, rank=rank))
        if rank:
            w.pins.add(3000)
            events.write(schema.record(schema.FINDING, rank=rank, step=3000, detector="x"))
        events.close()
        for n in range(1, 8001):
            w.write(n, fps(n, odd=4 if (rank == 2 and n == 3000) else None))
        w.close()
    slow, fast = both(run, monkeypatch)
    same(slow, fast)
    assert fast["step"] == 3000 and fast["tensors"][0]["tensor"] == "layer4.weight"


def restarted(run: Path, killed_at: int, last: int, odd: tuple[int, int, int]) -> Path:
    """Three ranks' fingerprints, every rank killed after ``killed_at`` and restarted to ``last``; ``odd``: (rank,
    tensor, step) that departs from there on. The blocks stay on through the restart."""
    rank_odd, tensor, since = odd
    for rank in range(3):
        folder = layout.rank_dir(run, rank)
        for attempt, steps in ((0, range(1, killed_at + 1)), (1, range(killed_at + 1, last + 1))):
            w = SnapshotWriter(folder, share=None)
            for n in steps:
                w.write(n, fps(n, odd=tensor if (rank == rank_odd and n >= since) else None))
            kill(w) if attempt == 0 else w.close()
            assert w.blocks.on
        (folder / layout.EVENTS).touch()
    return run


def test_a_restarted_rank_makes_blocks_of_what_its_killed_attempt_left_open(tmp_path, monkeypatch):
    """All ranks killed at step 1,500, mid-block, and restarted from 1,501: rank 1 departed at 1,100, in the
    block the killed attempt never wrote. The restarted writer makes it from the stream; diff finds it."""
    run = restarted(tmp_path / "run", killed_at=1500, last=2600, odd=(1, 3, 1100))
    slow, fast = both(run, monkeypatch)
    same(slow, fast)
    assert fast["step"] == 1100 and fast["tensors"][0]["ranks"] == [1]


def test_a_rank_restarted_before_its_first_block_still_has_blocks(tmp_path, monkeypatch):
    """Killed at step 300, before its first block was flushed, and restarted: the empty blocks file says the
    stream has blocks, so the new writer blocks the killed attempt's steps and goes on; diff finds a departure
    among them through the blocks."""
    run = restarted(tmp_path / "run", killed_at=300, last=3000, odd=(0, 2, 200))
    slow, fast = both(run, monkeypatch)
    same(slow, fast)
    assert fast["step"] == 200 and fast["tensors"][0]["ranks"] == [0]


def test_a_restart_on_a_record_whole_but_for_its_newline_keeps_it_in_the_index(tmp_path, monkeypatch):
    """A write short of its newline only (the record whole), the rank killed before the next save, then
    restarted: the new writer ends that line, and its index has the record as the whole read does."""
    from distdebug.artifacts import writer

    monkeypatch.setattr(writer, "INDEX_EVERY", 1)  # the index saved after the start: the finding is its tail
    live = layout.events_path(tmp_path, 0)
    w = EventWriter(live, index=True)
    w.write(schema.record(schema.START, rank=0))
    os.close(w._fd)  # noqa: SLF001 (killed)
    with open(live, "ab") as f:
        f.write(json.dumps(schema.record(schema.FINDING, rank=0, step=7, detector="x"), separators=(",", ":"))
                .encode())  # no newline: the disk took all but it
    w = EventWriter(live, index=True)
    w.write(schema.record(schema.START, rank=0, attempt=1))
    w.close()
    got, truth = load_rank(0, live.parent), whole(tmp_path, 0)
    assert got.indexed and got.records == truth.records and got.damaged_lines == truth.damaged_lines == 0
    assert [r["kind"] for r in got.records] == [schema.START, schema.FINDING, schema.START]


def test_a_damaged_fingerprint_record_ends_the_parse_and_never_loops():
    from distdebug.fingerprint.snapshots import _HEAD, parse_records

    data = _HEAD.pack(1, 0, 1) + bytes(8) + _HEAD.pack(2, 0, -3) + bytes(64)  # a negative count
    assert list(parse_records(data, [["a"]])) == [1]


def test_a_failed_rotation_stops_the_index_and_the_blocks_where_they_were_right(tmp_path, monkeypatch):
    """A rename the file system refuses (EIO) after two rotations: the writers go on in the file they have;
    the index and the blocks stop where their positions were still true, and the reads through them give what
    the whole reads give. A rotation half done (renamed, no new live file) is read whole."""
    share = retention.Share(64 << 10)
    real = retention.Rotation.rotate
    calls = {"n": 0}

    def rotate(self):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] > 2 and self.live.name == layout.EVENTS:
            raise OSError(5, "Input/output error")
        return real(self)

    monkeypatch.setattr(retention.Rotation, "rotate", rotate)
    recs = records(0, range(1, 1501))
    w = write(tmp_path, 0, recs, share)
    assert w.indexer is not None and not w.indexer.on
    got, truth = load_rank(0, layout.rank_dir(tmp_path, 0)), whole(tmp_path, 0)
    assert [r for r in got.records if r["kind"] not in schema.BULK] == \
        [r for r in truth.records if r["kind"] not in schema.BULK]
    assert got.digest.last_step == 1500
    live = layout.events_path(tmp_path, 0)  # a rotation half done: the live file renamed, no new one
    nxt = json.loads(layout.index_path(live).read_text())["pos"]["next"]
    os.replace(live, layout.segment_path(live, max(n for n, _ in layout.segments(live)) + 1))
    assert nxt < max(n for n, _ in layout.segments(live)) + 1 and not load_rank(0, live.parent).indexed


def test_a_record_the_disk_cut_before_its_newline_is_ended_at_close_and_at_a_restart(tmp_path):
    """The last record cut just before its newline (counted whole) is ended at close, so readers keep it; a
    restarted writer on a file that ends in a cut line begins with a newline, so its start joins nothing."""
    live = layout.events_path(tmp_path, 0)
    w = EventWriter(live, index=True)
    w.write(schema.record(schema.START, rank=0))
    w._cut = True  # noqa: SLF001 (as _write leaves it after a write short of its newline)
    w.close()
    assert live.read_bytes().endswith(b"\n\n")
    with open(live, "ab") as f:
        f.write(b'{"v":1,"kind":"step","rank":0,"st')  # a line an earlier attempt's disk cut
    w = EventWriter(live, index=True)
    w.write(schema.record(schema.START, rank=0, attempt=1))
    w.close()
    recs, damaged = read_stream(live)
    assert [r.get("attempt") for r in recs if r["kind"] == schema.START] == [None, 1] and damaged == 1


def test_a_block_sum_tells_a_swap_between_steps():
    """Two fingerprints swapped between two steps of a block: the block's digest differs (the step is mixed in)."""
    from distdebug.fingerprint.snapshots import mix

    a, b = np.array([1, 2], dtype=np.uint64), np.array([3, 4], dtype=np.uint64)
    assert not np.array_equal(mix(a, 1) + mix(b, 2), mix(b, 1) + mix(a, 2))

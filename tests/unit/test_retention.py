"""Tier 1: the run-directory budget (issue 48, item 1). The real writers, driven with synthetic steps, keep a
rank's streams within their share however many steps are written; the first steps, the last steps and each
finding's neighbourhood stay whole; every other step is still accounted for (a summary or a digest); readers
see one stream in order, follow it across rotations, and diff tells what a thinned step can still tell."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from distdebug.analysis import diff
from distdebug.artifacts import layout, retention, schema
from distdebug.artifacts.reader import Follow, load_run, read_stream
from distdebug.artifacts.writer import EventWriter
from distdebug.fingerprint.snapshots import SnapshotWriter, read_roots
from distdebug.fingerprint.snapshots import read_stream as read_fps


def stream_bytes(live: Path) -> int:
    total = 0
    for p in layout.stream_files(live):
        try:
            total += p.stat().st_size
        except FileNotFoundError:  # thinned and deleted (by the thinner's thread) since the listing
            pass
    return total


def step(rank: int, n: int, loss: float | None = None, attempt: int = 0) -> dict:
    return schema.record(schema.STEP, rank=rank, step=n, attempt=attempt, time=0.0,
                         loss=loss if loss is not None else 1.0 + 1.0 / n, step_time_s=0.01 + n % 7 * 0.001,
                         backward_calls=1, collectives=3)


def finding(rank: int, n: int) -> dict:
    return schema.record(schema.FINDING, rank=rank, step=n, detector="loss_spike", subject="loss",
                         severity="warning", message="a spike")


def test_sizes_parse_and_print():
    assert retention.parse_size("256M") == 256 << 20 and retention.parse_size("1G") == 1 << 30
    assert retention.parse_size("512KiB") == 512 << 10 and retention.parse_size("1048576") == 1 << 20
    assert retention.parse_size("1.5g") == 3 << 29
    for bad in ("", "M", "-1M", "lots", "nanM"):
        with pytest.raises((ValueError, IndexError)):
            retention.parse_size(bad)
    assert retention.size_text(256 << 20) == "256MiB"


def test_pins_merge_cover_and_stop_at_their_most(monkeypatch):
    pins = retention.Pins()
    pins.add(100)
    pins.add(130)  # overlaps: one interval 80..150
    pins.add(1000)
    assert pins.lo == [80, 980] and pins.hi == [150, 1020]
    assert pins.covers(80) and pins.covers(150) and not pins.covers(151) and pins.covers(1020)
    assert not pins.covers(None) and not pins.covers(79)
    monkeypatch.setattr(retention, "MOST_PINS", 2)
    pins.add(5000)
    assert pins.dropped == 1 and not pins.covers(5000)


def test_thinning_keeps_every_record_but_the_steps_and_accounts_for_every_step():
    records = [schema.record(schema.START, rank=0, attempt=0)]
    for n in range(1, 3001):
        records.append(step(0, n))
        if n % 500 == 0:
            records.append(schema.record(schema.MEMORY, rank=0, step=n, total=n * 10))
        records.append(schema.record(schema.HARNESS_COST, rank=0, steps=n))
    records.insert(1500, finding(0, 750))
    pins = retention.Pins()
    pins.add(750)
    out = retention.thin_events(records, pins.covers)
    kinds = [r["kind"] for r in out]
    assert kinds[0] == schema.START and kinds.count(schema.FINDING) == 1
    kept = [r["step"] for r in out if r["kind"] == schema.STEP]
    assert kept == list(range(730, 771))  # the finding's neighbourhood, whole
    summaries = [r for r in out if r["kind"] == schema.STEPS_THINNED]
    assert sum(s["steps"] for s in summaries) + len(kept) == 3000  # every step counted once
    first = summaries[0]
    assert (first["first"], first["last"], first["window"]) == (1, 729, 1000)
    assert first["loss"][0] == pytest.approx(1 + 1 / 729) and first["loss"][2] == 2.0
    assert first["memory_total_max"] == 5000
    assert [r["steps"] for r in out if r["kind"] == schema.HARNESS_COST] == [3000]  # cumulative: the last
    # In order: the finding sits among its neighbourhood's steps, after the summary of the steps before them.
    assert kinds.index(schema.STEPS_THINNED) < kinds.index(schema.FINDING) < len(kinds) - 1 - kinds[::-1].index(
        schema.STEP)


def test_a_new_attempt_starts_new_windows():
    records = [schema.record(schema.START, rank=0, attempt=0)] + [step(0, n) for n in range(1, 11)] + \
        [schema.record(schema.START, rank=0, attempt=1)] + [step(0, n, attempt=1) for n in range(1, 6)]
    out = retention.thin_events(records, lambda s: False)
    assert [(r["kind"], r.get("steps")) for r in out] == [
        (schema.START, None), (schema.STEPS_THINNED, 10), (schema.START, None), (schema.STEPS_THINNED, 5)]


def test_the_thinned_file_fits_its_cap_by_doubling_windows():
    records = retention.thin_events([step(0, n) for n in range(1, 200_001)], lambda s: False)
    assert len(records) == 201  # windows of 1000 by step number: 1-999, 1000-1999, ..., 200000
    cap = retention._size(records) // 3
    fitted = retention.fit_thinned(records, cap)
    assert retention._size(fitted) <= cap * 3 // 4
    assert sum(r["steps"] for r in fitted) == 200_000
    assert fitted[0]["first"] == 1 and fitted[-1]["last"] == 200_000 and fitted[0]["median_approx"]
    assert min(r["loss"][0] for r in fitted) == pytest.approx(1 + 1 / 200_000)


def write_steps(writer: EventWriter, rank: int, steps: range, findings: tuple[int, ...] = ()) -> None:
    for n in steps:
        writer.write(step(rank, n))
        if n in findings:
            writer.write(finding(rank, n))


def test_event_writer_stays_in_its_share_and_keeps_head_ring_and_pins(tmp_path):
    share = retention.Share(256 << 10)
    live = tmp_path / "rank-00000" / layout.EVENTS
    w = EventWriter(live, share=share)
    w.write(schema.record(schema.START, rank=0, attempt=0))
    sizes = []
    for block in range(10):
        write_steps(w, 0, range(block * 10_000 + 1, (block + 1) * 10_000 + 1), findings=(25_000, 61_000))
        assert w.thinner is not None and w.thinner.settle()  # thinned in the background: its work in hand done
        sizes.append(stream_bytes(live))
    w.write(schema.record(schema.END, rank=0, exit_code=0))
    w.close()
    assert max(sizes) <= share.total, sizes  # within its share at every point, whatever the length
    assert sizes[-1] < 2 * sizes[3]  # flat once the ring filled, not growing with the steps
    assert len(layout.segments(live)) == 1 + retention.RING  # the head and the ring: the file count is bounded
    records, damaged = read_stream(live)
    assert damaged == 0
    assert records[0]["kind"] == schema.START and records[-1]["kind"] == schema.END
    whole = [r["step"] for r in records if r["kind"] == schema.STEP]
    assert whole[:100] == list(range(1, 101))  # the first steps
    assert whole[-100:] == list(range(99_901, 100_001))  # the last steps
    for f in (25_000, 61_000):
        assert set(range(f - retention.PIN_BEFORE, f + retention.PIN_AFTER + 1)) <= set(whole)
    assert [r["step"] for r in records if r["kind"] == schema.FINDING] == [25_000, 61_000]
    summaries = [r for r in records if r["kind"] == schema.STEPS_THINNED]
    assert summaries and len(whole) + sum(s["steps"] for s in summaries) == 100_000  # every step accounted for
    steps_in_order = [r.get("step", r.get("first")) for r in records
                      if r["kind"] in (schema.STEP, schema.STEPS_THINNED)]
    assert steps_in_order == sorted(steps_in_order)
    # load_run reads the whole stream (the report and every reader go through it).
    run = load_run(tmp_path)
    assert len(run.ranks[0].of_kind(schema.STEP)) == len(whole)


def test_without_a_share_nothing_rotates(tmp_path):
    live = tmp_path / layout.EVENTS
    w = EventWriter(live)
    write_steps(w, 0, range(1, 3001))
    w.close()
    assert layout.stream_files(live) == [live] and len(read_stream(live)[0]) == 3000


def test_a_restarted_writer_continues_the_segments_and_keeps_the_old_pins(tmp_path):
    share = retention.Share(64 << 10)
    live = tmp_path / layout.EVENTS
    w = EventWriter(live, share=share)
    write_steps(w, 0, range(1, 601), findings=(590,))
    w.close()
    before = layout.segments(live)
    assert before
    w = EventWriter(live, share=share)  # the next attempt of the rank
    assert w.pins.covers(600) and w.pins.covers(570)
    write_steps(w, 0, range(601, 6001))
    w.close()
    after = [n for n, _ in layout.segments(live)]
    assert after[0] == 0 and after[-1] > before[-1][0]
    whole = {r["step"] for r in read_stream(live)[0] if r["kind"] == schema.STEP}
    assert set(range(570, 611)) <= whole
    # The fingerprint writer of the restarted rank reads the same pins from the event stream.
    assert SnapshotWriter(tmp_path, share=share).pins.covers(590)


def test_follow_sees_every_record_once_across_rotations(tmp_path):
    share = retention.Share(64 << 10)
    live = tmp_path / layout.EVENTS
    w = EventWriter(live, share=share)
    follow = Follow(live)
    seen: list[int] = []
    for block in range(60):
        write_steps(w, 0, range(block * 100 + 1, (block + 1) * 100 + 1))
        seen += [r["step"] for r in follow.read()]
    w.close()
    assert layout.segments(live)  # it rotated many times
    assert seen == list(range(1, 6001))
    late = Follow(live)  # a reader that comes late reads what is left, in order
    steps = [r.get("step", r.get("first")) for r in late.read()]
    assert steps == sorted(steps) and steps[-1] == 6000


def fps(n: int, tensors: int = 50, odd: int | None = None) -> dict[str, int]:
    return {f"layer{i}.weight": (n * 1_000_003 + i + (7 if i == odd else 0)) for i in range(tensors)}


def write_fingerprints(run: Path, steps: int, share: retention.Share, diverge: dict[int, tuple[int, int]]) -> None:
    """Two ranks' snapshots; ``diverge``: step -> (rank, tensor) that differs there."""
    for rank in (0, 1):
        w = SnapshotWriter(layout.rank_dir(run, rank), share=share)
        w.pins.add(3000)
        for n in range(1, steps + 1):
            bad = diverge.get(n)
            w.write(n, fps(n, odd=bad[1] if bad and bad[0] == rank else None))
        w.close()


def test_fingerprints_stay_in_their_share_and_diff_tells_what_a_thinned_step_can(tmp_path):
    share = retention.Share(2 << 20)
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    write_fingerprints(clean, 8000, share, {})
    write_fingerprints(faulty, 8000, share, {2000: (1, 7), 3000: (1, 9)})
    rank_dir = layout.rank_dir(faulty, 1)
    live = rank_dir / layout.FINGERPRINTS
    total = sum(p.stat().st_size for p in layout.stream_files(live)) + \
        (rank_dir / layout.FINGERPRINT_ROOTS).stat().st_size
    assert total <= share.total
    lists = json.loads((rank_dir / layout.FINGERPRINT_NAMES).read_text())["names"]
    whole, roots = read_fps(rank_dir, lists), read_roots(rank_dir)
    assert 1 in whole and 8000 in whole and 3000 in whole and 2980 in whole  # head, ring, a pin
    assert 2000 not in whole and 2000 in roots and set(whole) | set(roots) == set(range(1, 8001))
    # The first divergence is at a thinned step: found by its digest, named as such, the odd rank unknown.
    result = diff.rank_result(faulty, None)
    assert result["step"] == 2000 and result["thinned"] and not result["identical"]
    assert result["tensors"][0]["tensor"] == diff.THINNED and result["tensors"][0]["groups"] == [[0], [1]]
    # A whole step still names its tensor.
    at_pin = diff.rank_result(faulty, 3000)
    assert not at_pin["thinned"] and [t["tensor"] for t in at_pin["tensors"]] == ["layer9.weight"]
    # The clean twin: identical everywhere, thinned steps included.
    assert diff.rank_result(clean, None)["identical"] and diff.rank_result(clean, 2000)["thinned"]
    # Run against run: the first thinned step that differs, and none for a run against itself.
    assert diff.runs_result(clean, faulty)["step"] == 2000
    assert diff.runs_result(clean, clean)["identical"]


def test_digests_of_a_whole_and_a_thinned_step_compare(tmp_path):
    """A run kept whole (no budget) against one thinned: the digest of the whole step equals the thinned one."""
    whole, thinned, small = tmp_path / "whole", tmp_path / "thinned", tmp_path / "small"
    for run, share in ((whole, None), (thinned, retention.Share(1 << 20)), (small, retention.Share(128 << 10))):
        w = SnapshotWriter(layout.rank_dir(run, 0), share=share)
        for n in range(1, 5001):
            w.write(n, fps(n, odd=3 if (run is thinned and n == 2000) else None))
        w.close()
    assert 2000 in read_roots(layout.rank_dir(thinned, 0))
    result = diff.runs_result(whole, thinned)
    assert (result["step"], result["rank"], result["compared"]) == (2000, 0, 2000)
    assert diff.runs_result(whole, small)["identical"]
    # Past their cap the digests are halved (every other step's kept): the roots file stays within it.
    roots = layout.rank_dir(small, 0) / layout.FINGERPRINT_ROOTS
    assert 0 < roots.stat().st_size <= retention.Share(128 << 10).roots
    snaps = diff.load_snapshots(whole)
    assert len(snaps[0]) == 5000 and np.all(snaps[0][1][1] == np.array(list(fps(1).values()), dtype=np.uint64))


def test_follow_across_more_rotations_than_the_ring_counts_the_gap_and_never_repeats(tmp_path):
    """A reader that sleeps through more rotations than the ring holds: what was thinned before it read it is a
    gap (counted; its findings are in the thinned file), nothing is read twice, the order holds."""
    share = retention.Share(32 << 10)
    live = tmp_path / layout.EVENTS
    w = EventWriter(live, share=share)
    follow = Follow(live)
    seen: list[int] = []
    for block in range(20):
        write_steps(w, 0, range(block * 400 + 1, (block + 1) * 400 + 1))
        assert w.thinner is not None and w.thinner.settle()
        seen += [r["step"] for r in follow.read() if r["kind"] == schema.STEP]
    w.close()
    assert follow.gaps > 0
    assert seen == sorted(set(seen)) and seen[-1] == 8000


def test_a_divergence_pinned_on_one_rank_and_thinned_on_the_other_is_found(tmp_path):
    """The online check's finding is rank 0's: only rank 0 pins the step, rank 1 keeps a digest of it."""
    share = retention.Share(2 << 20)
    for rank in (0, 1):
        w = SnapshotWriter(layout.rank_dir(tmp_path, rank), share=share)
        if rank == 0:
            w.pins.add(2000)
        for n in range(1, 8001):
            w.write(n, fps(n, odd=4 if (rank == 1 and n >= 2000) else None))
        w.close()
    assert 2000 in read_roots(layout.rank_dir(tmp_path, 1)) and 2000 not in read_roots(layout.rank_dir(tmp_path, 0))
    result = diff.rank_result(tmp_path, None)
    assert result["step"] == 2000 and not result["identical"] and result["tensors"][0]["groups"] == [[0], [1]]


def test_halving_keeps_the_same_steps_on_every_rank():
    from distdebug.fingerprint.snapshots import _ROOT, halve

    a = np.array([(s, 0, 1, s) for s in range(1, 1001)], dtype=_ROOT)
    b = np.array([(s, 0, 1, s) for s in range(1, 1001) if not 500 <= s < 541], dtype=_ROOT)  # rank b pinned more
    ka, kb = halve(a), halve(b)
    assert len(ka) <= 500 and len(kb) <= len(b) // 2
    assert set(kb["step"].tolist()) <= set(ka["step"].tolist()) or set(ka["step"].tolist()) <= set(kb["step"].tolist())


def test_thinning_runs_off_the_writing_thread_and_the_writer_takes_it_over_only_when_it_falls_behind(
        tmp_path, monkeypatch):
    """A rotation costs the writing thread (the training's) a rename: the segment leaving the ring is read and
    summarised on the writer's thinner thread. Records that come faster than they are summarised (a segment
    still waiting at the next rotation) are thinned by the writer itself: the stream stays in its share."""
    import threading

    threads: list[str] = []
    real = retention.thin_events

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(retention, "thin_events", spy)
    share = retention.Share(64 << 10)  # the events' share of the smallest budget, 512K
    w = EventWriter(tmp_path / "paced" / layout.EVENTS, share=share)
    for n in range(1, 2001, 5):  # a step's pace: the thinner done before the next rotation
        write_steps(w, 0, range(n, n + 5))
        assert w.thinner is not None and w.thinner.settle()
    w.close()
    assert threads and all(name.startswith("distdebug-thin-") for name in threads), set(threads)
    threads.clear()
    live = tmp_path / "flood" / layout.EVENTS
    w = EventWriter(live, share=share)
    sizes = []
    for n in range(1, 20001, 100):  # as fast as it can
        write_steps(w, 0, range(n, n + 100))
        sizes.append(stream_bytes(live))
    w.close()
    assert max(sizes) <= share.total, max(sizes)
    assert threading.current_thread().name in threads  # it took the thinning over when it fell behind
def test_a_thinned_step_says_which_ranks_it_could_not_compare(tmp_path):
    """Rank 2 fingerprints a tensor the others do not have: at a whole step diff names it; at a thinned step
    only digests of different tensor sets are left, so rank 2 is said not compared, never called identical."""
    share = retention.Share(1 << 20)
    for rank in (0, 1, 2):
        w = SnapshotWriter(layout.rank_dir(tmp_path, rank), share=share)
        for n in range(1, 5001):
            values = fps(n)
            if rank == 2:
                values["extra.weight"] = n
            w.write(n, values)
        w.close()
    result = diff.rank_result(tmp_path, 1000)
    assert result["thinned"] and result["identical"] and result["not_compared"] == [[2]]
    assert diff.rank_result(tmp_path, 4990)["not_compared"] == []  # a whole step: compared tensor by tensor


def test_shares_fit_their_total_and_a_large_budget_keeps_segments_small():
    """The worst case of a stream (head, ring, live, one segment waiting for the thinner, the thinned file and
    the roots at their caps) fits its share; a large budget keeps more segments, not larger ones (the
    thinner reads a segment whole)."""
    for budget in (512 << 10, 256 << 20, 4 << 30, 100 << 30):
        for share in retention.shares(budget):
            worst = (share.ring + 3) * share.segment + share.thinned + share.roots
            assert worst <= share.total, (budget, share)
            assert share.segment <= retention.MOST_SEGMENT and share.ring >= retention.RING
    assert retention.shares(100 << 30)[1].ring > 300


def test_no_thread_to_be_had_thins_on_the_writer_and_close_leaves_no_thread(tmp_path, monkeypatch):
    """A process at its thread limit (Thread.start raises): the writer thins itself, nothing reaches the
    training; and a writer's close ends its thinner thread (none runs into interpreter teardown)."""
    import threading

    share = retention.Share(64 << 10)
    w = EventWriter(tmp_path / "ok" / layout.EVENTS, share=share)
    write_steps(w, 0, range(1, 3001))
    w.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("distdebug-thin-")]

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    live = tmp_path / "limit" / layout.EVENTS
    w = EventWriter(live, share=share)
    write_steps(w, 0, range(1, 3001))  # never raises
    w.close()
    assert stream_bytes(live) <= share.total and layout.thinned_path(live).exists()

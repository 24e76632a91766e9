"""Tier 1: the live view's reading of a run directory as the ranks write it (issue 39, item 2)."""

from __future__ import annotations

import json

from distdebug.analysis.live import Follower, node_line, running, snapshot_rows
from distdebug.artifacts import layout


def rec(**r):
    return (json.dumps({"v": 1, **r}) + "\n").encode()


def test_each_file_is_read_from_where_it_stopped_and_a_half_written_record_waits(tmp_path):
    for rank in (0, 1):
        layout.rank_dir(tmp_path, rank).mkdir(parents=True)
        layout.events_path(tmp_path, rank).write_bytes(
            rec(kind="start", rank=rank, node=0, host="h", time=100.0)
            + b"".join(rec(kind="step", rank=rank, step=s, loss=2.0 - s / 10, step_time_s=0.05 * (1 + rank),
                           time=100.0 + s * (1 + rank) / 10) for s in range(1, 6)))
    f = Follower([tmp_path])
    ranks = f.poll()
    assert [r.step for r in ranks.values()] == [5, 5] and round(ranks[0].steps_per_s, 6) == 10.0
    line = node_line(list(ranks.values()))
    assert line.startswith("distdebug: node 0 | step 5 | 5 steps/s | loss 1.5 | slowest rank 1 (100 ms)"), line
    assert line.endswith("findings 0")
    # rank 1 falls behind and writes half a record: the half waits, then counts once complete
    whole = rec(kind="finding", rank=1, severity="warning", detector="straggler", step=6)
    with layout.events_path(tmp_path, 1).open("ab") as out:
        out.write(whole[:20])
    with layout.events_path(tmp_path, 0).open("ab") as out:
        out.write(rec(kind="step", rank=0, step=6, loss=1.3, step_time_s=0.05, time=100.6))
    ranks = f.poll()
    assert (ranks[0].step, ranks[1].findings) == (6, 0)
    with layout.events_path(tmp_path, 1).open("ab") as out:
        out.write(whole[20:] + rec(kind="end", rank=1, exit_code=0))
    ranks = f.poll()
    assert ranks[1].findings == 1 and ranks[1].worst == "warning" and ranks[1].status == "exited 0"
    assert "slowest rank 1" in node_line(list(ranks.values())) and "findings 1 (worst: warning)" in node_line(
        list(ranks.values()))
    assert running(ranks)  # rank 0 has no end record
    (tmp_path / "nodes").mkdir()
    layout.node_path(tmp_path, 0).write_text(json.dumps({"node_rank": 0, "started": 1.0, "ended": 2.0}))
    assert not running(ranks, [tmp_path])  # its launcher ended: so did the job
    rows = snapshot_rows(ranks, now=110.6)
    assert [(r["rank"], r["step"], r["status"], r["last_record_s_ago"]) for r in rows] == [
        (0, 6, "running", 10.0), (1, 5, "exited 0", 9.6)]


def test_the_slowest_rank_of_synchronous_ranks_is_the_one_the_straggler_scores_name_not_the_longest_step(tmp_path):
    # Ranks that synchronise every step wait for the slowest: their step times are equal to the millisecond, and
    # the longest was the rank that waited longest (rank 0 here, waiting for rank 1 sleeping in its forward).
    # Rank 0's straggler_scores measure each rank's own work: they name rank 1. Its clean twin: alike scores and
    # alike step times name no one.
    def write(run, scores, times):
        for rank in (0, 1):
            layout.rank_dir(run, rank).mkdir(parents=True)
            body = rec(kind="start", rank=rank, node=0, time=100.0) + b"".join(
                rec(kind="step", rank=rank, step=s, loss=1.0, step_time_s=times[rank], time=100.0 + s / 5)
                for s in range(1, 9))
            if rank == 0 and scores:
                body += rec(kind="straggler_scores", rank=0, step=8,
                            ranks={str(r): {"score": v, "work_s": 0.01} for r, v in scores.items()})
            layout.events_path(run, rank).write_bytes(body)
        return Follower([run]).poll()

    ranks = write(tmp_path / "straggler", {0: 1.0, 1: 0.05}, {0: 0.2104, 1: 0.2101})
    assert ranks[1].score == 0.05 and ranks[0].score == 1.0  # rank 0's record, about both ranks
    line = node_line(list(ranks.values()))
    assert "slowest rank 1 (score 0.05)" in line and "slowest rank 0" not in line, line
    clean = write(tmp_path / "clean", {0: 1.0, 1: 0.97}, {0: 0.0201, 1: 0.0203})
    assert "slowest" not in node_line(list(clean.values()))
    # no scores (the straggler detector off): equal step times name no one; a step well above the others does
    assert "slowest" not in node_line(list(write(tmp_path / "none", {}, {0: 0.2104, 1: 0.2101}).values()))
    assert "slowest rank 0 (300 ms)" in node_line(list(write(tmp_path / "apart", {}, {0: 0.3, 1: 0.1}).values()))


def test_a_rank_one_step_short_is_routine_two_behind_is_named_and_a_restart_forgets_the_last_scores(tmp_path):
    from distdebug.analysis.live import RankLive, slowest

    def live(rank, step, score=None, t=0.1):
        return RankLive(rank, node=0, step=step, step_time_s=t, score=score)

    # the files are read one after another: one step short is a healthy job, and a near-1 score names no one
    assert slowest([live(0, 101, 0.98), live(1, 100, 1.0)]) is None
    assert "slowest" not in node_line([live(0, 101, 0.98), live(1, 100, 1.0)])
    assert "slowest rank 1 (2 steps behind)" in node_line([live(0, 102, 1.0), live(1, 100, 1.0)])
    # rank 0's newest scores replace the last whole; its restart forgets them
    for rank in (0, 1):
        layout.rank_dir(tmp_path, rank).mkdir(parents=True)
    steps = b"".join(rec(kind="step", rank=1, step=s, loss=1.0, step_time_s=0.1, time=100.0 + s) for s in (1, 2))
    layout.events_path(tmp_path, 1).write_bytes(rec(kind="start", rank=1, node=0, time=100.0) + steps)
    layout.events_path(tmp_path, 0).write_bytes(
        rec(kind="start", rank=0, node=0, time=100.0) + steps.replace(b'"rank": 1', b'"rank": 0')
        + rec(kind="straggler_scores", rank=0, step=2, ranks={"0": {"score": 1.0}, "1": {"score": 0.3}}))
    f = Follower([tmp_path])
    assert f.poll()[1].score == 0.3
    with layout.events_path(tmp_path, 0).open("ab") as out:
        out.write(rec(kind="straggler_scores", rank=0, step=4, ranks={"0": {"score": 1.0}}))
    assert f.poll()[1].score is None  # not in the newest record: not its old score
    with layout.events_path(tmp_path, 0).open("ab") as out:
        out.write(rec(kind="straggler_scores", rank=0, step=6, ranks={"0": {"score": 1.0}, "1": {"score": 0.3}})
                  + rec(kind="start", rank=0, node=0, time=200.0, attempt=1))
    assert f.poll()[1].score is None  # a restart: the last attempt's straggler is not this one's

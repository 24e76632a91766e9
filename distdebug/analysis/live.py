"""What a running job is doing now, per rank, read from its run directory as the ranks write it: the live
view (``attach``'s status line per node on a terminal, ``distdebug top``).

Why the run directory: the ranks already append their step records there; following the files costs the
training nothing (no message, no lock, no collective). Each file is read from where the last read stopped
(a partial last line waits for its end), and only what the view shows is kept: the last step's values, a
few recent step times, counts. A file of a million steps costs its bytes once, and memory stays flat.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distdebug import strictjson
from distdebug.artifacts import layout, schema
from distdebug.artifacts.reader import Follow, load_indexed
from distdebug.findings import Severity

SEVERITIES = {s.value for s in Severity}

RATE_STEPS = 20
"""Step records the steps/s is measured over (the most recent)."""


@dataclass
class RankLive:
    """One rank as its records say now."""

    rank: int
    node: int | None = None
    host: str | None = None
    step: int = 0
    loss: float | None = None
    step_time_s: float | None = None
    findings: int = 0
    worst: str | None = None
    """The most severe finding's severity so far (None: none)."""
    status: str = "starting"
    """starting, running, stalled, exited N, raised."""
    last_record: float | None = None
    """Wall time of its newest record."""
    times: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_STEPS))
    """Wall times of its most recent step records."""
    score: float | None = None
    """Its relative speed from rank 0's last ``straggler_scores`` (1.0: as fast as the fastest; None: none yet)."""

    @property
    def steps_per_s(self) -> float | None:
        if len(self.times) < 2 or self.times[-1] <= self.times[0]:
            return None
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])

    def feed(self, r: dict[str, Any]) -> None:
        kind = r.get("kind")
        if isinstance(r.get("time"), (int, float)):
            self.last_record = r["time"]
        if kind == schema.START:  # a restart begins again (its steps go on from the checkpoint's)
            self.node, self.host, self.status = r.get("node"), r.get("host"), "running"
            self.times.clear()
        elif kind == schema.STEP:
            self.step = r.get("step") or self.step
            self.loss = r.get("loss", self.loss)
            self.step_time_s = r.get("step_time_s", self.step_time_s)
            if isinstance(r.get("time"), (int, float)):
                self.times.append(r["time"])
            if self.status in ("starting", "stalled"):
                self.status = "running"
        elif kind == schema.FINDING:
            self.findings += 1
            sev = r.get("severity")
            if sev in SEVERITIES and (self.worst is None or Severity(sev).order > Severity(self.worst).order):
                self.worst = sev
        elif kind == schema.STALL:
            self.status = "stalled"
        elif kind == schema.STALL_CLEARED:
            self.status = "running"
        elif kind == schema.SCRIPT_ERROR:
            self.status = f"raised {r.get('exception')}"
        elif kind == schema.END:
            if not self.status.startswith("raised"):
                self.status = f"exited {r.get('exit_code')}"


class Follower:
    """Follows every rank's events file of a run directory (or several: one job's nodes), incrementally."""

    def __init__(self, run_dirs: list[Path], ranks: list[int] | None = None) -> None:
        self.run_dirs = run_dirs
        self.only = set(ranks) if ranks is not None else None
        self.ranks: dict[int, RankLive] = {}
        self._follow: dict[Path, Follow] = {}
        self.scores: dict[int, float] = {}
        """Rank -> its relative speed, from rank 0's last straggler_scores record."""

    def _files(self) -> list[tuple[int, Path]]:
        out = []
        for run_dir in self.run_dirs:
            out += [(rank, folder / layout.EVENTS) for rank, folder in layout.rank_dirs(run_dir)
                    if self.only is None or rank in self.only]
        return sorted(out)

    def poll(self) -> dict[int, RankLive]:
        """Read what each rank's stream gained since the last poll (across its rotations); the ranks now."""
        for rank, path in self._files():
            live = self.ranks.setdefault(rank, RankLive(rank))
            follow = self._follow.get(path)
            if follow is None:
                got = load_indexed(rank, path)  # a long run's rank: its index and what followed, not every line
                if got is not None:
                    stream, follow = got
                    self._follow[path] = follow
                    for rec in stream.records:
                        self._feed(live, rec)
                    if stream.digest.straggler:  # the index keeps the last scores (only them: not a newer record)
                        self._scores(stream.digest.straggler)
                    continue
                follow = self._follow[path] = Follow(path)
            for rec in follow.read():
                self._feed(live, rec)
        for rank, live in self.ranks.items():
            live.score = self.scores.get(rank)
        return dict(sorted(self.ranks.items()))

    def _feed(self, live: RankLive, rec: dict[str, Any]) -> None:
        live.feed(rec)
        kind = rec.get("kind")
        if kind == schema.STRAGGLER_SCORES:
            self._scores(rec)
        elif kind == schema.START and live.rank == 0:  # a restart: the last attempt's scores say nothing of this one
            self.scores = {}

    def _scores(self, rec: dict[str, Any]) -> None:
        """Rank 0's straggler_scores record, about every rank: the newest replaces the last whole."""
        self.scores = {int(r): float(row["score"]) for r, row in (rec.get("ranks") or {}).items()
                       if isinstance(row, dict) and isinstance(row.get("score"), (int, float))}


def running(ranks: dict[int, RankLive], run_dirs: list[Path] | None = None) -> bool:
    """Whether any rank may still be running: one without its end record, unless every launcher agent of the
    run directories has ended (a rank killed before it could write one is then over too)."""
    if run_dirs and launchers_ended(run_dirs):
        return False
    return not ranks or any(not (r.status.startswith("exited") or r.status.startswith("raised"))
                            for r in ranks.values())


def launchers_ended(run_dirs: list[Path]) -> bool:
    """Every launcher agent's node file says it ended (and there is one at least)."""
    files = [f for d in run_dirs for _, f in layout.node_files(d)]
    if not files:
        return False
    for f in files:
        try:
            if "ended" not in strictjson.loads(f.read_text()):
                return False
        except (OSError, ValueError):
            return False
    return True


SLOW_SCORE = 0.9
"""A rank the straggler detector scores below this (its work 11% longer than the fastest's) is named the slowest."""
SLOW_STEP = 1.2
"""Without scores: a last step this much longer than the other ranks' median names its rank."""
BEHIND = 2
"""Steps a rank must lag the others by to be named behind: the files are read one after another, so a rank one
step short is routine in a healthy job."""


def slowest(ranks: list[RankLive]) -> RankLive | None:
    """The rank furthest behind (``BEHIND`` steps or more); else the rank the straggler detector scores slowest,
    when it is; else, without scores, a last step well above the others' (None when all are alike or unknown).

    Why not simply the longest last step: ranks that synchronise every step wait for the slowest, so their step
    times are equal to the millisecond, and the longest was whichever rank waited longest for the straggler,
    named instead of it. The scores (rank 0's ``straggler_scores``) measure each rank's own work."""
    stepping = [r for r in ranks if r.step_time_s is not None]
    if len(stepping) < 2:
        return None
    lowest = min(r.step for r in stepping)
    if max(r.step for r in stepping) - lowest >= BEHIND:
        return min(stepping, key=lambda r: (r.step, -(r.step_time_s or 0.0)))
    scored = [r for r in stepping if r.score is not None]
    if len(scored) >= 2:
        slow = min(scored, key=lambda r: (r.score or 0.0, r.rank))
        return slow if (slow.score or 0.0) < SLOW_SCORE else None
    slow = max(stepping, key=lambda r: (r.step_time_s or 0.0, -r.rank))
    others = statistics.median(r.step_time_s or 0.0 for r in stepping if r is not slow)
    return slow if (slow.step_time_s or 0.0) > SLOW_STEP * others else None


def node_line(ranks: list[RankLive], now: float | None = None) -> str:
    """One line for one node's ranks: step, steps/s, last loss, slowest rank, findings so far."""
    if not ranks:
        return "distdebug: waiting for the ranks to start"
    node = ranks[0].node
    step = min(r.step for r in ranks)
    rates = [r.steps_per_s for r in ranks if r.steps_per_s is not None]
    losses = [r.loss for r in ranks if r.loss is not None]
    slow = slowest(ranks)
    found = sum(r.findings for r in ranks)
    worst = max((r.worst for r in ranks if r.worst), key=lambda s: Severity(s).order, default=None)
    parts = [f"node {node if node is not None else '?'}", f"step {step}"]
    parts.append(f"{min(rates):.3g} steps/s" if rates else "- steps/s")
    parts.append(f"loss {losses[0]:.4g}" if losses else "loss -")
    if slow is not None:
        behind = max(r.step for r in ranks) - slow.step
        parts.append(f"slowest rank {slow.rank} ({behind} steps behind)" if behind >= BEHIND else
                     f"slowest rank {slow.rank} (score {slow.score:.2f})" if slow.score is not None else
                     f"slowest rank {slow.rank} ({slow.step_time_s * 1000:.0f} ms)" if slow.step_time_s else
                     f"slowest rank {slow.rank}")
    parts.append(f"findings {found}" + (f" (worst: {worst})" if worst else ""))
    stalled = [r.rank for r in ranks if r.status == "stalled"]
    if stalled:
        parts.append(f"stalled: rank(s) {', '.join(map(str, stalled))}")
    if now is not None:
        ages = [now - r.last_record for r in ranks if r.last_record is not None]
        if ages and min(ages) > 10:
            parts.append(f"quiet {min(ages):.0f} s")
    return "distdebug: " + " | ".join(parts)


def snapshot_rows(ranks: dict[int, RankLive], now: float | None = None) -> list[dict[str, Any]]:
    """``distdebug top``'s table, a row per rank (also its --json)."""
    now = time.time() if now is None else now
    return [{"rank": r.rank, "node": r.node, "host": r.host, "step": r.step, "steps_per_s": r.steps_per_s,
             "loss": r.loss, "step_time_ms": None if r.step_time_s is None else r.step_time_s * 1000,
             "findings": r.findings, "worst": r.worst, "status": r.status,
             "last_record_s_ago": None if r.last_record is None else round(now - r.last_record, 1)}
            for r in ranks.values()]

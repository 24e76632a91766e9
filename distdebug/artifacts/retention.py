"""How a rank's part of the run directory stays within its budget however long the job runs (issue 48).

A month-long job writes a step record and a fingerprint record every step; kept whole, a 1,000-tensor model
at 2 s a step fills 10 GB a rank. Each append-only stream (the events, the fingerprints) is therefore kept in
tiers, the way log rotation works, with nothing rewritten on the training thread but small files:

- the live file (``events.jsonl``) takes every record; at ``Share.segment`` bytes it is renamed to the next
  segment (``events.000001.jsonl``) and a new live file begins: one rename, no copy;
- segment 0, the job's first steps, is kept whole (the head);
- the newest ``Share.ring`` segments are kept whole (the ring: the last steps at full resolution; 3 but for
  a budget so large that its segments would be over ``MOST_SEGMENT``);
- a segment leaving the ring is thinned into the stream's thinned file and deleted: every finding, stall and
  start is kept as written, so is every step within ``PIN_BEFORE``/``PIN_AFTER`` of a finding (the pins), and
  the other steps become one summary per window of ``WINDOW`` steps (min/median/max of the loss, the step
  time, the backward and collective counts) or, for fingerprints, one digest of all tensors a step (the
  roots: ``distdebug diff`` still tells whether ranks agreed at a thinned step, not on which tensor);
- the thinned file has a cap: past it, adjacent summaries merge (windows double) and roots are halved.

Readers see one stream in order (``layout.stream_files``); a reader following the live file follows it
across a rotation (``reader.Follow``). Why rotation and not a ring buffer in one file: whatever was written
survives a kill of the rank (each record is one ``write()`` to a file that is never rewritten in place), and
a reader never sees a half-rewritten file.
"""

from __future__ import annotations

import bisect
import math
import os
import statistics
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from distdebug import envvars, strictjson
from distdebug.artifacts import layout, schema

RING = 3
"""The fewest rotated segments kept whole besides the live file (the newest steps at full resolution); a
large budget keeps more (``Share.ring``), its segments never over ``MOST_SEGMENT``."""
MOST_SEGMENT = 64 << 20
"""The largest segment: the thinner reads a whole segment into memory, whatever the budget."""
WINDOW = 1000
"""Steps per summary when a segment is thinned (before summaries merge under the thinned file's cap)."""
PIN_BEFORE = 20
PIN_AFTER = 20
"""Steps kept whole before and after every finding's step (its neighbourhood: what led to it, what followed)."""
MOST_PINS = 1000
"""Findings whose neighbourhood is pinned (the first ones): a detector that fires every step never pins it all."""
EVENTS_PART = 1 / 8
FINGERPRINTS_PART = 3 / 4
"""Each stream's part of a rank's budget; the rest holds the reserve, the stacks, the checkpoint records."""
REPEATED_FINDINGS = 10
"""Once its thinned file is over its cap, a stream keeps this many findings of one detector and subject."""
MOST_KEPT_FINDINGS = 200
"""Findings a thinned file keeps at the last resort (the first ones; the rest counted)."""
BULK = schema.BULK
"""The per-step kinds that thinning summarises; every other record is kept as written."""


@dataclass(frozen=True)
class Share:
    """One stream's bytes: the live file and each segment up to ``segment`` (one record more at most), the
    head and ``ring`` segments whole, one segment more while it waits to be thinned (in the background), the
    thinned file up to ``thinned``, the roots up to ``roots``: 3 segments + 3/10 + 1/4 + 1/8 of ``total``,
    at most 97.5 % of it (a segment is at most a tenth)."""

    total: int

    @property
    def segment(self) -> int:
        return min(MOST_SEGMENT, max(4096, self.total // 10))

    @property
    def ring(self) -> int:
        return max(RING, int(self.total * 0.3) // self.segment)

    @property
    def thinned(self) -> int:
        # fit_thinned parses the whole file: never more than a few segments' worth, whatever the budget
        return min(4 * MOST_SEGMENT, max(4096, self.total // 4))

    @property
    def roots(self) -> int:
        return max(4096, self.total // 8)


def shares(budget: int) -> tuple[Share, Share]:
    """The events' and the fingerprints' shares of a rank's budget."""
    return Share(int(budget * EVENTS_PART)), Share(int(budget * FINGERPRINTS_PART))


def rank_shares() -> tuple[Share | None, Share | None]:
    """This rank's events' and fingerprints' shares of ``--run-dir-budget`` (set by attach); None: unbounded."""
    try:
        budget = int(envvars.get(envvars.RUN_DIR_BUDGET) or 0)
    except ValueError:
        budget = 0
    return shares(budget) if budget > 0 else (None, None)


def parse_size(text: str) -> int:
    """``256M``, ``1G``, ``512K``, ``1048576`` -> bytes (binary units); ValueError when it is none of these."""
    t = text.strip().upper()
    for suffix in ("IB", "B"):
        if t.endswith(suffix) and len(t) > len(suffix):
            t = t[:-len(suffix)]
            break
    mult = 1
    if t[-1:] in ("K", "M", "G", "T"):
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[t[-1]]
        t = t[:-1]
    number = t
    value = float(number)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(text)
    return int(value * mult)


def size_text(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g}{unit}iB"
    return f"{n} B"


class Pins:
    """The steps kept whole when their segment is thinned: each finding's neighbourhood (the first
    ``MOST_PINS`` findings'). Intervals in step order; any thread may add."""

    def __init__(self) -> None:
        self.lo: list[int] = []
        self.hi: list[int] = []
        self.dropped = 0
        self._lock = threading.Lock()  # findings arrive on the exchange's thread, rotations on the training's

    def add(self, step: int) -> None:
        with self._lock:
            self._add(step)

    def _add(self, step: int) -> None:
        lo, hi = step - PIN_BEFORE, step + PIN_AFTER
        i = bisect.bisect_left(self.lo, lo)
        if (i < len(self.lo) and self.lo[i] <= hi) or (i > 0 and self.hi[i - 1] >= lo):
            j = i - 1 if i > 0 and self.hi[i - 1] >= lo else i
            self.lo[j], self.hi[j] = min(self.lo[j], lo), max(self.hi[j], hi)
            return
        if len(self.lo) >= MOST_PINS:
            self.dropped += 1
            return
        self.lo.insert(i, lo)
        self.hi.insert(i, hi)

    def covers(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        with self._lock:
            i = bisect.bisect_right(self.lo, step) - 1
            return i >= 0 and self.hi[i] >= step

    def add_from(self, records: Iterable[dict]) -> None:
        for r in records:
            if r.get("kind") == schema.FINDING and isinstance(r.get("step"), int):
                self.add(r["step"])


def recover_pins(pins: Pins, events: Path) -> None:
    """A restarted rank's pins (an elastic restart's new process): every finding its event stream holds, in
    every file of it (a finding in the thinned file still pins steps of the segments after it)."""
    for path in layout.stream_files(events):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for raw in data.split(b"\n"):
            if b'"kind":"finding"' in raw:
                try:
                    pins.add_from([strictjson.loads(raw)])
                except ValueError:
                    pass


class Thinner:
    """A writer's thinning, off the thread that writes: a segment leaving the ring is read, summarised and
    appended by one daemon thread, so that a rotation costs the writing thread (the training's) one rename.
    ``kick`` after each rotation; ``settle`` waits for the work asked so far (a test); ``stop`` at the
    writer's close waits a little for the work in hand and ends the thread (none runs into teardown)."""

    def __init__(self, work: Callable[[], None], name: str) -> None:
        self._work = work
        self._name = name
        self._cond = threading.Condition()
        self._asked = 0  # kicks so far
        self._done = 0  # kicks the thread has answered (a run after a kick answers every kick before it)
        self._stopping = False
        self._running = threading.Lock()  # one thinning at a time: the thread's or the writer's own
        self._thread: threading.Thread | None = None

    def after_rotation(self, rotation: Rotation) -> None:
        """After the writer's rotation: the thread thins what left the ring; but when a segment is still
        waiting from the rotation before (records come faster than they are summarised), the writer thins
        itself, now: the bound on a stream's size holds whatever the rate (one segment waits at most)."""
        if len(rotation.leaving_ring()) > 1 or not self.kick():
            self._run()

    def _run(self) -> None:
        with self._running:
            try:
                self._work()
            except Exception:  # the writer's thinning never ends the rank; the segment is thinned next time
                pass

    def kick(self) -> bool:
        """Ask the thread to thin; False when there is no thread (it could not start: the caller thins)."""
        with self._cond:
            if self._stopping:
                return False
            if self._thread is None:
                thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # no thread to be had (a process or thread limit): never the training's
                    return False
                self._thread = thread
            self._asked += 1
            self._cond.notify_all()
            return True

    def settle(self, timeout: float = 10.0) -> bool:
        """Wait until every kick so far is answered (``timeout`` seconds at most); whether it is."""
        with self._cond:
            asked = self._asked
            return self._cond.wait_for(lambda: self._done >= asked or self._thread is None, timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """The writer's close: the work asked so far, ``timeout`` seconds at most, then the thread ends (a
        segment left unthinned is thinned by the next attempt's writer, at its first rotation)."""
        self.settle(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=0.5)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._asked > self._done or self._stopping)
                if self._stopping and self._asked <= self._done:
                    return
                asked = self._asked
            self._run()
            with self._cond:
                self._done = asked
                self._cond.notify_all()


class Rotation:
    """The segment files of one stream whose live file is ``live``: renaming the live file to the next
    segment, and which segments have left the ring."""

    def __init__(self, live: Path, ring: int = RING) -> None:
        self.live = live
        self.ring = ring
        done = layout.segments(live)
        self.next = done[-1][0] + 1 if done else 0

    def rotate(self) -> Path:
        """The live file becomes segment ``next`` (a rename; the caller closed its descriptor first)."""
        path = layout.segment_path(self.live, self.next)
        os.replace(self.live, path)
        self.next += 1
        return path

    def leaving_ring(self) -> list[Path]:
        """Segments past the newest ``ring`` (never segment 0, the head), oldest first."""
        ring = [(n, p) for n, p in layout.segments(self.live) if n > 0]
        return [p for _, p in ring[:-self.ring]] if len(ring) > self.ring else []


# ---------------------------------------------------------------- events: thinning (pure)
def _stats(values: list[float]) -> list[float] | None:
    return [min(values), statistics.median(values), max(values)] if values else None


class _Window:
    """The steps of one summary window, accumulating."""

    def __init__(self, key: tuple, window: int) -> None:
        self.key = key
        self.window = window
        self.steps: list[int] = []
        self.fields: dict[str, list[float]] = {"loss": [], "step_time_s": [], "backward_calls": [], "collectives": []}
        self.nonfinite = 0
        self.skipped = 0
        self.memory_max: float | None = None

    def add(self, r: dict) -> None:
        self.steps.append(int(r["step"]))
        for k, values in self.fields.items():
            v = r.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if math.isfinite(v):
                    values.append(v)
                elif k == "loss":
                    self.nonfinite += 1
        self.skipped += bool(r.get("skipped"))

    def record(self) -> dict:
        rank, attempt, _ = self.key
        out = schema.record(schema.STEPS_THINNED, rank=rank, attempt=attempt, first=self.steps[0],
                            last=self.steps[-1], steps=len(self.steps), window=self.window)
        for k, values in self.fields.items():
            out[k] = _stats(values)
        if self.nonfinite:
            out["nonfinite_losses"] = self.nonfinite
        if self.skipped:
            out["skipped"] = self.skipped
        if self.memory_max is not None:
            out["memory_total_max"] = self.memory_max
        return out


def thin_events(records: list[dict], pinned: Callable[[object], bool], window: int = WINDOW) -> list[dict]:
    """A segment's records as its thinned part: every record kept in order but the per-step kinds (``BULK``):
    a step a pin covers is kept whole, the others become one ``steps_thinned`` summary per window of
    ``window`` steps in place of the last; the harness cost (cumulative) and the straggler scores keep their
    last record before each start and at the end; a memory record's total goes into its window's summary."""
    out: list[dict] = []
    acc: _Window | None = None
    memory_max: float | None = None
    latest: dict[str, dict] = {}

    def flush() -> None:
        nonlocal acc, memory_max
        if acc is not None:
            acc.memory_max = memory_max
            out.append(acc.record())
            acc, memory_max = None, None

    def flush_latest() -> None:
        out.extend(latest.pop(k) for k in (schema.HARNESS_COST, schema.STRAGGLER_SCORES) if k in latest)

    for r in records:
        kind = r.get("kind")
        if kind not in BULK:
            if kind == schema.START:
                flush()
                flush_latest()
            out.append(r)
            continue
        step = r.get("step")
        if pinned(step) or (kind == schema.STEP and not isinstance(step, int)):
            if kind == schema.STEP:
                flush()
            out.append(r)
        elif kind == schema.STEP:
            assert isinstance(step, int)
            key = (r.get("rank"), r.get("attempt"), step // window)
            if acc is not None and acc.key != key:
                flush()
            if acc is None:
                acc = _Window(key, window)
            acc.add(r)
        elif kind == schema.MEMORY:
            total = r.get("total")
            if isinstance(total, (int, float)):
                memory_max = total if memory_max is None else max(memory_max, total)
        else:
            latest[str(kind)] = r
    flush()
    flush_latest()
    return out


def merge_summaries(a: dict, b: dict) -> dict:
    """Two adjacent windows' summaries as one (min and max exact; the median the steps-weighted mean of the
    two medians, marked approximate)."""
    out = dict(a)
    out.update(first=a["first"], last=b["last"], steps=a["steps"] + b["steps"], window=b["last"] - a["first"] + 1,
               median_approx=True)
    for k in ("loss", "step_time_s", "backward_calls", "collectives"):
        x, y = a.get(k), b.get(k)
        if x and y:
            med = (x[1] * a["steps"] + y[1] * b["steps"]) / (a["steps"] + b["steps"])
            out[k] = [min(x[0], y[0]), med, max(x[2], y[2])]
        else:
            out[k] = x or y
    for k in ("nonfinite_losses", "skipped", "findings_dropped"):
        if a.get(k) or b.get(k):
            out[k] = (a.get(k) or 0) + (b.get(k) or 0)
    mem = [m for m in (a.get("memory_total_max"), b.get("memory_total_max")) if m is not None]
    if mem:
        out["memory_total_max"] = max(mem)
    return out


def _merge_pass(records: list[dict]) -> tuple[list[dict], bool]:
    out: list[dict] = []
    merged = False
    for r in records:
        prev = out[-1] if out else None
        if (r.get("kind") == schema.STEPS_THINNED and prev is not None and prev.get("kind") == schema.STEPS_THINNED
                and not prev.get("_fresh") and prev.get("rank") == r.get("rank")
                and prev.get("attempt") == r.get("attempt")):
            out[-1] = merge_summaries(prev, r)
            out[-1]["_fresh"] = True  # one merge per summary a pass: windows double evenly
            merged = True
        else:
            out.append(r)
    for r in out:
        r.pop("_fresh", None)
    return out, merged


def _size(records: list[dict]) -> int:
    return sum(len(strictjson.dumps(r, separators=(",", ":"), default=str)) + 1 for r in records)


def window_stats(records: Iterable[dict], before: dict | None = None) -> dict | None:
    """What the thinned file's summaries hold, in a few numbers (``events.thinned.json``, beside it, so that a
    reader at scale says what was thinned without reading the file): summaries, steps, the smallest and
    largest window, the first and last step; ``before``: the same of what the file held already."""
    out = dict(before) if before else None
    for r in records:
        n = r.get("steps")
        if r.get("kind") != schema.STEPS_THINNED or not n:
            continue
        if out is None:
            out = {"summaries": 0, "steps": 0, "smallest": n, "largest": n, "first": r.get("first"),
                   "last": r.get("last")}
        out["summaries"] += 1
        out["steps"] += int(n)
        out["smallest"], out["largest"] = min(out["smallest"], n), max(out["largest"], n)
        out["last"] = r.get("last")
    return out


def fit_thinned(records: list[dict], cap: int) -> list[dict]:
    """The thinned file's records brought to 3/4 of ``cap``: adjacent summaries merge (windows double), then
    the steps kept whole by pins become summaries too, then a detector's findings on one subject past the
    first ``REPEATED_FINDINGS`` are counted on the summary after them instead of kept, then records other
    than findings, stalls and starts go. Always ends."""
    target = cap * 3 // 4
    size = _size(records)
    while size > target:
        records, merged = _merge_pass(records)
        new = _size(records)
        if not merged or new == size:
            break
        size = new
    if size > target:
        records = thin_events(records, lambda _s: False)
        size = _size(records)
        while size > target:
            records, merged = _merge_pass(records)
            if not merged:
                break
            size = _size(records)
    if size > target:
        seen: dict[tuple, int] = {}
        dropped = 0
        kept: list[dict] = []
        for r in records:
            if r.get("kind") == schema.FINDING:
                key = (r.get("detector"), r.get("subject"))
                seen[key] = seen.get(key, 0) + 1
                if seen[key] > REPEATED_FINDINGS:
                    dropped += 1
                    continue
            elif r.get("kind") == schema.STEPS_THINNED and dropped:
                r = {**r, "findings_dropped": (r.get("findings_dropped") or 0) + dropped}
                dropped = 0
            kept.append(r)
        records = kept
        size = _size(records)
    if size > target:  # the essential records, a discovery and its process group: the rest goes
        keep = schema.ESSENTIAL | {schema.DISCOVERY, schema.PG_INIT, schema.STEPS_THINNED}
        records = [r for r in records if r.get("kind") in keep]
        size = _size(records)
    if size > target:  # findings on ever new subjects (a detector naming each step): the first ones and a count
        findings = [i for i, r in enumerate(records) if r.get("kind") == schema.FINDING]
        cut = set(findings[MOST_KEPT_FINDINGS:])
        if cut:
            records = [r for i, r in enumerate(records) if i not in cut] + [
                schema.record(schema.STEPS_THINNED, first=None, last=None, steps=0, window=0,
                              findings_dropped=len(cut))]
    return records

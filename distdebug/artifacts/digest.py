"""What the readers need of a rank's per-step records, kept as the records go by: a bounded digest (issue 48,
reading at scale).

A report on 1,024 ranks x 100,000 steps cannot read every step record (tens of GB of JSON Lines); what it
shows of them is a few figures per rank: the last step, the first and last loss, the median step time, the
largest memory record, the last harness-cost and straggler records, the curves the HTML page draws, the
step times of the profiler windows, and the last steps themselves (a hang's verdict reads their collective
counts). ``Digest`` keeps exactly these, in a size that does not grow with the run, fed one record at a time.

The rank's writer feeds it every record it writes and saves it as the rank's ``index.json`` (with the
position in the stream it covers, artifacts.writer.Indexer); a reader loads the index and feeds it what the
stream holds past that position (artifacts.reader.load_rank). A run directory without an index (an older
one, or a rank whose index could not be kept) is read whole and fed to the same class: on a stream kept whole
both ways give the same figures; on one the budget thinned, the whole read has only the summaries of the
thinned windows, which count at their medians (their steps' step time, loss and collectives), where the
index saw every step.

Figures that cannot be kept exactly in bounded memory are approximated, the same way on both paths:
- the median step time is exact up to EXACT steps, then comes from a histogram of bins ``2 ** (1/512)``
  apart (within 0.07 % of the exact median; an even count takes the lower middle's bin);
- the curves are bucket means over ``width`` steps, the width doubling (adjacent buckets merged) whenever
  there would be more than ``CURVE`` buckets;
- a profiler window's step times are those of its steps written after its ``trace`` record or among the
  last RECENT per-step records before it: a window longer than that loses its first steps' times.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from distdebug import strictjson
from distdebug.artifacts import schema

BULK = schema.BULK
RECENT = 64
"""The last bulk records kept as written (a hang's verdict reads the last steps' collective counts)."""
CURVE = 512
"""The most buckets of a curve (loss and step time per step for the HTML report's plots)."""
BIN = math.log(2) / 512
"""Log-width of a step-time histogram bin: relative spacing 0.135 %."""
EXACT = 256
"""Up to this many values a histogram also keeps them, and its median is exact (a short run's figures as
they always were); past it the bins alone answer."""
MOST_BINS = 4096
"""Bins kept per histogram; past it the two closest bins merge (never seen: that spans a factor of 250)."""
MOST_TRACED = 4096
"""Step times kept for profiler windows (the steps of each window and the one after it)."""


def _bin(seconds: float) -> int:
    return round(math.log(seconds) / BIN)


class Histogram:
    """Counts of values by log bin: a median within a bin's half width, in a few KB whatever the count."""

    def __init__(self, bins: dict[int, int] | None = None, values: list[float] | None = None) -> None:
        self.bins: dict[int, int] = bins or {}
        self.values: list[float] | None = values if values is not None else ([] if not self.bins else None)
        """Every value while there are at most EXACT (None past it)."""

    def add(self, value: Any, count: int = 1) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
            return
        if self.values is not None:
            self.values += [float(value)] * count
            if len(self.values) > EXACT:
                self.values = None
        b = _bin(float(value))
        self.bins[b] = self.bins.get(b, 0) + count
        if len(self.bins) > MOST_BINS:
            keys = sorted(self.bins)
            i = min(range(len(keys) - 1), key=lambda j: keys[j + 1] - keys[j])
            self.bins[keys[i + 1]] += self.bins.pop(keys[i])

    def median(self) -> float | None:
        if self.values:
            return statistics.median(self.values)
        n = sum(self.bins.values())
        if not n:
            return None
        rank, seen = (n + 1) // 2, 0
        for b in sorted(self.bins):
            seen += self.bins[b]
            if seen >= rank:
                return math.exp(b * BIN)
        return None  # pragma: no cover (the loop always reaches the rank)

    def to_json(self) -> dict[str, Any]:
        return {"bins": [[b, c] for b, c in sorted(self.bins.items())], "values": self.values}

    @classmethod
    def from_json(cls, data: Any) -> Histogram:
        data = data or {}
        values = data.get("values")
        return cls({int(b): int(c) for b, c in data.get("bins") or []},
                   [float(v) for v in values] if isinstance(values, list) else None)


class Curve:
    """Per-step values as bucket sums over ``width`` steps (a power of two), at most CURVE buckets."""

    def __init__(self, width: int = 1, buckets: dict[int, list[float]] | None = None) -> None:
        self.width = width
        self.buckets: dict[int, list[float]] = buckets or {}
        """bucket index ((step - 1) // width) -> [loss sum, loss count, step-time sum, step-time count]."""
        self._text: dict[int, str] = {}
        """The JSON of buckets that no longer change (all but the newest): a save writes them again, but
        formats only what changed (an index save every 256 records would otherwise spend most of its time
        printing 2,000 floats)."""

    def add(self, step: int, loss: Any, seconds: Any, count: int = 1) -> None:
        k = max(0, step - 1) // self.width
        b = self.buckets.get(k)
        if b is None:
            b = self.buckets[k] = [0.0, 0, 0.0, 0]
        if _number(loss):
            b[0] += float(loss) * count
            b[1] += count
        if _number(seconds):
            b[2] += float(seconds) * count
            b[3] += count
        while len(self.buckets) > CURVE:
            self.width *= 2
            self._text = {}
            merged: dict[int, list[float]] = {}
            for i, v in self.buckets.items():
                m = merged.setdefault(i // 2, [0.0, 0, 0.0, 0])
                for j in range(4):
                    m[j] += v[j]
            self.buckets = merged

    def series(self, what: str) -> dict[int, float]:
        """First step of each bucket -> the mean of ``loss`` or ``step_time_s`` over the bucket's steps."""
        s, n = (0, 1) if what == "loss" else (2, 3)
        return {k * self.width + 1: v[s] / v[n] for k, v in sorted(self.buckets.items()) if v[n]}

    def to_json(self) -> dict[str, Any]:
        return {"width": self.width, "buckets": [[k, *v] for k, v in sorted(self.buckets.items())]}

    def dumps(self) -> str:
        """``to_json``'s text, the unchanged buckets' from the cache."""
        keys = sorted(self.buckets)
        parts = []
        for k in keys:
            text = self._text.get(k)
            if text is None:
                text = strictjson.dumps([k, *self.buckets[k]])
                if k != keys[-1]:
                    self._text[k] = text
            parts.append(text)
        return f'{{"width":{self.width},"buckets":[{",".join(parts)}]}}'

    @classmethod
    def from_json(cls, data: Any) -> Curve:
        data = data or {}
        return cls(int(data.get("width") or 1), {int(b[0]): [float(b[1]), int(b[2]), float(b[3]), int(b[4])]
                                                 for b in data.get("buckets") or []})


def _record(entry: tuple[Any, ...]) -> dict[str, Any]:
    """A ``Digest.recent`` entry's record: kept, or parsed from its text."""
    return entry[1] if entry[1] is not None else strictjson.loads(entry[2])


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Digest:
    """One rank's per-step records, digested; everything but ``seq`` is of the current attempt (a ``start``
    record begins a new one, as ``RankStream.last_attempt`` does)."""

    def __init__(self) -> None:
        self.seq = 0
        """Records fed so far (every attempt): the position of the next record in the rank's stream."""
        self._attempt()

    def _attempt(self) -> None:
        self.last_step: int | None = None
        self.collectives = 0
        """The collectives of every step record (a hang's verdict counts what a stuck rank entered since)."""
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.times = Histogram()
        """Every step record's step time."""
        self.work = Histogram()
        """Step times past step 1 with the harness on (the harness's cost is judged against these)."""
        self.memory_max: dict[str, Any] | None = None
        self.harness_cost: dict[str, Any] | None = None
        self.straggler: dict[str, Any] | None = None
        self.curve = Curve()
        self.traced: dict[int, float] = {}
        """step -> step time (s) of the steps of each profiler window and of the step after it."""
        self._windows: list[list[int]] = []  # profiler windows whose steps may still come: [first, last]
        self.recent: deque[tuple[int, dict[str, Any] | None, str | None, Any, Any, Any]] = deque(maxlen=RECENT)
        """(seq, record, its JSON as written, kind, step, step time) of the last bulk records: the record itself
        only where there is no text (a digest loaded from its file, a record fed without its line), else parsed
        when asked for (a save, a reader). A dict kept 64 steps is an object the interpreter's collector promotes
        and a full collection walks; a tuple of a string and numbers is not tracked once the collector has seen it
        (issue 62)."""
        self._texts: dict[str, str] = {}
        """The JSON as written of ``memory_max``, ``harness_cost``, ``straggler``: a save copies it."""

    def feed(self, r: dict[str, Any], text: str | None = None) -> None:
        """One record, in the stream's order; ``text``: its line as written (redacted), kept for the index."""
        kind = r.get("kind")
        seq = self.seq
        self.seq += 1
        if kind == schema.START:
            self._attempt()
        elif kind == schema.STEP:
            self._step(r)
        elif kind == schema.STEPS_THINNED:
            self._thinned(r)
        elif kind == schema.MEMORY:
            total = r.get("total")
            if _number(total) and (self.memory_max is None or total > self.memory_max.get("total", 0)):
                self.memory_max = r
                self._keep("memory_max", text)
        elif kind == schema.HARNESS_COST:
            self.harness_cost = r
            self._keep("harness_cost", text)
        elif kind == schema.STRAGGLER_SCORES:
            self.straggler = r
            self._keep("straggler", text)
        elif kind == schema.TRACE:
            window = r.get("steps") or []
            if len(window) == 2 and all(isinstance(s, int) for s in window):
                a, b = window
                for _, _, _, old_kind, old_step, old_seconds in self.recent:  # written before its trace record
                    self._traced(old_kind, old_step, old_seconds, a, b)
                self._windows = [*self._windows[-7:], [a, b]]
        if kind in BULK:
            self.recent.append((seq, None if text is not None else r, text, kind, r.get("step"),
                                r.get("step_time_s")))

    def _keep(self, name: str, text: str | None) -> None:
        if text is None:
            self._texts.pop(name, None)
        else:
            self._texts[name] = text

    def _step(self, r: dict[str, Any]) -> None:
        step = r.get("step")
        if not isinstance(step, int):
            return
        self.last_step = step
        if isinstance(r.get("collectives"), int):
            self.collectives += r["collectives"]
        loss, seconds = r.get("loss"), r.get("step_time_s")
        if loss is not None:
            self.first_loss = loss if self.first_loss is None else self.first_loss
            self.last_loss = loss
        if seconds:
            self.times.add(seconds)
            if step > 1 and r.get("harness") != "off":
                self.work.add(seconds)
        self.curve.add(step, loss, seconds)
        for a, b in self._windows:
            self._traced(schema.STEP, step, seconds, a, b)
        self._windows = [w for w in self._windows if step <= w[1] + 1]

    def _traced(self, kind: Any, step: Any, seconds: Any, a: int, b: int) -> None:
        if (kind == schema.STEP and isinstance(step, int) and a <= step <= b + 1 and seconds
                and len(self.traced) < MOST_TRACED):
            self.traced[step] = float(seconds)

    def _thinned(self, r: dict[str, Any]) -> None:
        """A window of steps the run-directory budget summarised (a stream read whole, without an index): its
        steps counted at their median, its loss range's ends as the first and last loss it can tell."""
        n = int(r.get("steps") or 0)
        last = r.get("last")
        if not n or not isinstance(last, int):
            return
        self.last_step = last
        counts = r.get("collectives") or []
        if len(counts) == 3 and _number(counts[1]):  # a sum it no longer has: its steps at their median
            self.collectives += round(counts[1] * n)
        loss = r.get("loss") or []
        seconds = r.get("step_time_s") or []
        if len(loss) == 3 and self.first_loss is None:
            self.first_loss = loss[1]
        if len(loss) == 3:
            self.last_loss = loss[1]
        if len(seconds) == 3 and seconds[1]:
            self.times.add(seconds[1], n)
            self.work.add(seconds[1], n)
        self.curve.add(int(r.get("first") or last), loss[1] if len(loss) == 3 else None,
                       seconds[1] if len(seconds) == 3 else None, n)

    # ------------------------------------------------------------ what readers ask
    def median_step_time_s(self) -> float | None:
        return self.times.median()

    def work_median_ms(self) -> float | None:
        m = self.work.median()
        return m * 1e3 if m is not None else None

    def recent_records(self) -> list[tuple[int, dict[str, Any]]]:
        return [(e[0], _record(e)) for e in self.recent]

    # ------------------------------------------------------------ the index file's body
    def _numbers(self) -> dict[str, Any]:
        """The body's fields that are numbers only (the rest are records and the curve)."""
        return {"seq": self.seq, "last_step": self.last_step, "collectives": self.collectives,
                "first_loss": self.first_loss, "last_loss": self.last_loss, "times": self.times.to_json(),
                "work": self.work.to_json(), "traced": [[s, t] for s, t in sorted(self.traced.items())],
                "windows": self._windows}

    def to_json(self) -> dict[str, Any]:
        return {**self._numbers(), "memory_max": self.memory_max, "harness_cost": self.harness_cost,
                "straggler": self.straggler, "curve": self.curve.to_json(),
                "recent": [[e[0], _record(e)] for e in self.recent]}

    def dumps(self) -> str:
        """``to_json``'s text, written for every index save: the records as the stream has them (redacted),
        the curve's unchanged buckets from its cache; a few tens of microseconds, not a millisecond."""
        parts = [strictjson.dumps(self._numbers())[:-1]]
        for name in ("memory_max", "harness_cost", "straggler"):
            value = getattr(self, name)
            parts.append(f'"{name}":{self._texts.get(name) or strictjson.dumps(value, default=str)}')
        parts.append(f'"curve":{self.curve.dumps()}')
        recent = ",".join(f"[{e[0]},{e[2] or strictjson.dumps(e[1], default=str)}]" for e in self.recent)
        parts.append(f'"recent":[{recent}]')
        return parts[0] + "," + ",".join(parts[1:]) + "}"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Digest:
        out = cls()
        out.seq = int(d["seq"])
        out.last_step = d.get("last_step")
        out.collectives = int(d.get("collectives") or 0)
        out.first_loss, out.last_loss = d.get("first_loss"), d.get("last_loss")
        out.times, out.work = Histogram.from_json(d.get("times")), Histogram.from_json(d.get("work"))
        out.memory_max, out.harness_cost, out.straggler = d.get("memory_max"), d.get("harness_cost"), d.get("straggler")
        out.curve = Curve.from_json(d.get("curve"))
        out.traced = {int(s): float(t) for s, t in d.get("traced") or []}
        out._windows = [[int(a), int(b)] for a, b in d.get("windows") or []]
        out.recent = deque(((int(s), r, None, r.get("kind"), r.get("step"), r.get("step_time_s"))
                            for s, r in d.get("recent") or [] if isinstance(r, dict)), maxlen=RECENT)
        return out

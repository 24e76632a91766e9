"""What the harness costs the job, measured by the harness itself in every run (issue 18).

"Leave it on" is only a promise if the user can see the price. Each rank counts, as it trains:

- **training-thread time per detector**: every guarded hook and patch is timed around its call (a
  patch's call of what it replaced is subtracted: that is the training's own time), and so is each
  detector's step-boundary work (``probe``, ``on_step``, ``attach``, ``after_backward``); the
  session's own part (the step's one read, the wrappers' bookkeeping, the boundary itself) is
  ``session``. Two ``perf_counter_ns()`` calls per hook call (about 0.1 us) are the price of this.
- **background threads' CPU time**: the harness's threads (named ``distdebug-*``: the exchange, the
  watchdog) from the OS's per-thread accounting (psutil); they do not stop training, but they share
  its cores.
- **host synchronisations**: device-to-host reads made by the harness (the budget is one a step).

What the first step costs (discovery, attach, the initial fingerprints) is start-up, paid once, and
kept apart; the per-step counters start at the end of step 1. So is work done once when something is
found (``one_off``: a step re-executed by rerun or nan_origin's on-demand watch): it is counted under
its own name, not in any owner's per-step time, so the steady cost a user pays for staying on is read
apart from what a finding cost once (a profiler window's cost is the training's own slowdown under the
profiler: analysis.cost reads it from the step times). They are cumulative: a ``harness_cost``
record carries them at the checked steps (2, 4, 8, then every 16) and at the end, so a killed run
keeps its last one. Analysis divides by the steps and compares with the median step (``analysis.cost``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from time import perf_counter_ns
from typing import Any

PROFILER_WINDOW = "a profiler window (its start and its trace's export)"
"""The one-off the profiler's windows are counted under; the report gives each window's whole price from its
steps' times instead (analysis.cost.profiler_windows), which holds this."""
SESSION = "session"
"""The owner of the session's own time (not a detector)."""

_claimed = threading.local()
"""Per thread: the time already given to some owner by regions inside the one running now."""


def timed(ledger: Ledger, owner: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its time given to ``owner``, less what regions inside it gave to others (the step
    boundary runs the detectors: their time is theirs, the rest the session's). For the per-step
    places; a hook, called many times a step, times itself with two clock reads (Detector.guarded)."""
    t0 = perf_counter_ns()
    c0 = claimed()
    try:
        return fn(*args)
    finally:
        dt = perf_counter_ns() - t0
        ledger.add(owner, dt - (claimed() - c0), 0)
        _claimed.ns = c0 + dt


def give(total: int) -> None:
    """This thread's claimed nanoseconds set to ``total`` (a timed region's end: what ``timed`` does inline)."""
    _claimed.ns = total


def claimed() -> int:
    """Nanoseconds this thread's regions have claimed so far (``timed``, ``one_off``): a self-timed region (a
    hook, a patch) takes the difference off its own time, as ``timed`` does."""
    return getattr(_claimed, "ns", 0)


@contextlib.contextmanager
def one_off(what: str, ledger: Ledger | None = None, count: bool = True, opens: int = 0) -> Iterator[None]:
    """A region of harness work done once, not every step: its time goes to ``what`` in the ledger's one-off
    counts and is claimed, so the detector's timed region around it does not count it as per-step time.
    count: this region is one more time of ``what`` (a window's start is not; its end is). opens: +1 when the
    region opens something that lasts over steps (a profiler window), -1 when it closes it: the in-job A/B
    leaves those steps out (runtime.overhead)."""
    ledger = ledger or LEDGER
    ledger.windows_open += opens
    t0 = perf_counter_ns()
    c0 = claimed()
    try:
        yield
    finally:
        dt = perf_counter_ns() - t0
        inner = claimed() - c0  # what regions inside gave their owners (already counted)
        ledger.once(what, dt - inner, count)
        _claimed.ns = c0 + dt


class Ledger:
    """Cumulative harness time of one rank, by owner (a detector's name, or ``session``)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.reads = 0
        self._thread_s: dict[str, float] = {}  # the largest CPU time seen per thread name (threads end)
        self._start: dict[str, Any] | None = None  # the totals at the end of step 1 (start-up, once)
        self._start_step = 0
        self._last: dict[str, Any] | None = None  # the totals at the end of the last step
        self._last_step = 0
        self.off_steps = 0
        """Steps run with the detectors paused (--measure-overhead's off blocks): no detector cost."""
        self.one_off_ns: dict[str, int] = {}
        self.one_off_times: dict[str, int] = {}
        self.one_off_regions = 0
        """One-off regions so far: a step in which it grows did work once (the in-job A/B leaves it out)."""
        self.windows_open = 0
        """One-off work lasting over steps, open now (a profiler window)."""
        self.off_session_ns = 0
        """The session's time in those steps (their step counting and record, the wrappers' check that the
        harness is off): what an off unit of the in-job A/B still pays, which its difference cannot see."""
        self._session_mark = 0

    def once(self, what: str, ns: int, count: bool = True) -> None:
        """``ns`` of one-off work (``one_off``)."""
        self.one_off_ns[what] = self.one_off_ns.get(what, 0) + ns
        self.one_off_times[what] = self.one_off_times.get(what, 0) + int(count)
        self.one_off_regions += 1

    def end_step(self, detectors: list[Any], step: int, backwards: int = 0) -> None:
        """A step boundary is over: its totals are what the per-step figures are made of (what comes after
        the last step, the drain at the end, is not a step's cost). The end of the first step also marks
        the start: what was spent until then (discovery, attach, the first fingerprints) is start-up,
        paid once, and the per-step figures count from there."""
        self._last, self._last_step = {**self._totals(detectors), "backwards": backwards}, step
        if self._start is None:
            self._start, self._start_step = self._last, step

    def step_mode(self, off: bool) -> None:
        """A step boundary is over; the step ran with the detectors paused (``off``) or not."""
        now = self.ns.get(SESSION, 0)
        if off:
            self.off_session_ns += now - self._session_mark
        self._session_mark = now

    def add(self, owner: str, ns: int, calls: int = 1) -> None:
        """``ns`` of training-thread time to ``owner`` (calls: how many hook or patch calls it covers)."""
        self.ns[owner] = self.ns.get(owner, 0) + ns
        self.calls[owner] = self.calls.get(owner, 0) + calls

    def _totals(self, detectors: list[Any]) -> dict[str, Any]:
        """The counters now (a few dict entries: cheap enough for every step boundary)."""
        ns = dict(self.ns)
        calls = dict(self.calls)
        for det in detectors:
            hook_ns, hook_calls = int(getattr(det, "cost_ns", 0)), int(getattr(det, "cost_calls", 0))
            if hook_ns or hook_calls:
                ns[det.name] = ns.get(det.name, 0) + hook_ns
                calls[det.name] = calls.get(det.name, 0) + hook_calls
        return {"ns": ns, "calls": calls, "reads": self.reads, "off": self.off_steps, "off_ns": self.off_session_ns}

    def snapshot(self) -> dict[str, Any]:
        """The record's fields: from the end of step 1 to the end of the last step, the ``steps`` counted,
        milliseconds per owner (detectors' hook and patch time included), calls and host reads; the
        background threads' CPU milliseconds (all of it: they start after step 1); and ``startup_ms`` per
        owner (until the end of step 1, once)."""
        for name, seconds in thread_cpu_s().items():
            self._thread_s[name] = max(self._thread_s.get(name, 0.0), seconds)
        empty: dict[str, Any] = {"ns": {}, "calls": {}, "reads": 0, "off": 0, "off_ns": 0, "backwards": 0}
        start, last = self._start or empty, self._last or empty

        def since(key: str) -> dict[str, Any]:
            return {k: v - start[key].get(k, 0) for k, v in last[key].items()}

        return {
            "steps": self._last_step - self._start_step,
            "off_steps": last["off"] - start["off"],
            "off_session_ms": round((last["off_ns"] - start["off_ns"]) / 1e6, 4),
            "backwards": last.get("backwards", 0) - start.get("backwards", 0),  # backward calls: forwards a step
            "training_thread_ms": {k: round(v / 1e6, 4) for k, v in sorted(since("ns").items())},
            "calls": dict(sorted(since("calls").items())),
            "threads_cpu_ms": {k: round(v * 1e3, 3) for k, v in sorted(self._thread_s.items())},
            "host_reads": last["reads"] - start["reads"],
            "startup_ms": {k: round(v / 1e6, 3) for k, v in sorted(start["ns"].items())},
            "one_off_ms": {k: [round(v / 1e6, 3), self.one_off_times.get(k, 0)]
                           for k, v in sorted(self.one_off_ns.items())},
        }


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of this process's live ``distdebug-*`` threads, by name: each one's own line in
    ``/proc/self/task`` (psutil reads every thread of the process, torch's dozens included: 0.7 ms a record in a
    rank here, against 0.1 for ours alone); psutil where there is no /proc."""
    ours = {t.native_id: t.name for t in threading.enumerate() if t.name.startswith("distdebug")}
    if not ours:
        return {}
    if _PROC:
        out: dict[str, float] = {}
        try:
            for tid, label in ours.items():
                try:
                    with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                        fields = f.read().rsplit(b")", 1)[1].split()
                except FileNotFoundError:  # the thread ended meanwhile
                    continue
                out[label] = out.get(label, 0.0) + (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
            return out
        except Exception:  # noqa: BLE001 (a /proc of another layout): psutil's reading
            pass
    try:
        import psutil

        found: dict[str, float] = {}
        for th in psutil.Process().threads():
            name = ours.get(th.id)
            if name is not None:
                found[name] = found.get(name, 0.0) + th.user_time + th.system_time
        return found
    except Exception:  # no per-thread accounting on this platform: the threads' cost is unknown
        return {}


def _ticks() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK")) or 100
    except (ValueError, OSError, AttributeError):
        return 100


_TICKS = _ticks()
_PROC = os.path.isdir("/proc/self/task")


LEDGER = Ledger()
"""This process's harness cost: the wrappers' bookkeeping (``quietly``) is the session's part (the session
puts its own ledger here when it is installed)."""


def quietly(fn: Callable[..., Any], *args: Any) -> Any:
    """Run the harness's bookkeeping in a wrapper of the script's call, timed as the session's; an exception of
    ours is swallowed, never the script's business."""
    try:
        return timed(LEDGER, SESSION, fn, *args)
    except Exception:
        return None

"""Profiler: torch.profiler traces of chosen steps on every rank (the practice of "profile steps 4995-5005
and read the timeline", made automatic), and of the steps right after a detector fires.

- ``--profile-steps A:B[,C:D...]``: torch.profiler runs from the start of step A to the end of step B
  (A >= 2: step boundaries are known from the end of step 1 on). Each step is marked
  ``ProfilerStep#N`` with N the optimizer step, the same on every rank, so windows line up across
  ranks. Each rank writes ``traces/steps-A-B/rank-NNNNN.pt.trace.json.gz``: torch's own gzip
  Chrome trace, with its ``distributedInfo``, which Perfetto and Holistic Trace Analysis open as is,
  and ``distdebug_window``: the steps that completed inside the window (a job that ends inside one
  leaves one more mark, which holds its end, not a step).
- ``--profile-on-finding N`` (default 5, 0: off): when loss_spike, nan_origin, loss_nonfinite or
  straggler reports a warning or worse, the next N steps are profiled on every rank, once per run.
  The rank that saw it writes the window's first step into the job's own store (the one
  init_process_group made); every rank looks for it every CHECK_EVERY steps, and the window
  starts at a multiple of CHECK_EVERY that every rank checks before it (lockstep training keeps
  ranks within a step of each other).

Outside windows a boundary costs one set lookup (and a store lookup every CHECK_EVERY steps
when triggered windows are on).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from distdebug.artifacts import layout, schema
from distdebug.cards.profiler import CARD
from distdebug.config import ProfilerConfig, parse_windows
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.runtime.cost import PROFILER_WINDOW

CHECK_EVERY = 8
TRIGGERS = ("loss_spike", "nan_origin", "loss_nonfinite", "straggler")
STORE_KEY = "distdebug/profile_trigger"


CHATTER = (b"USDT:", b"STAGE:")
"""Line prefixes torch's profiler (kineto) prints to the process's stderr at every start and stop,
whatever KINETO_LOG_LEVEL says: not the script's output, so they do not reach its stderr."""


def _spool() -> Any:
    """Where fd 2 goes for a moment: a file in memory (memfd) where Linux has it, so that a full or failing
    $TMPDIR never turns the script's own writes to stderr in that moment into an error; else a temporary file."""
    if hasattr(os, "memfd_create"):
        try:
            return os.fdopen(os.memfd_create("distdebug-profiler-stderr"), "w+b")
        except OSError:
            pass
    return tempfile.TemporaryFile()


@contextlib.contextmanager
def _without_profiler_chatter() -> Iterator[None]:
    """Fd 2 goes to a file while torch's profiler starts or stops; then everything written there,
    but the profiler's own lines, goes on to the real stderr (another thread's output is kept, a few
    milliseconds late)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        spool = _spool()
        os.dup2(spool.fileno(), 2)
    except Exception:  # no fd 2 to borrow: the chatter shows, nothing else changes
        yield
        return
    try:
        yield
    finally:
        try:
            sys.stderr.flush()
        except Exception:
            pass
        os.dup2(saved, 2)
        os.close(saved)
        try:
            spool.seek(0)
            kept = b"".join(line for line in spool.read().splitlines(keepends=True) if not line.startswith(CHATTER))
            if kept:
                os.write(2, kept)
        finally:
            spool.close()


def trace_dir(run_dir: Path, start: int, end: int) -> Path:
    return layout.trace_dir(run_dir, start, end)


class Profiler(Detector):
    name = "profiler"
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    Config = ProfilerConfig

    def __init__(self, config: ProfilerConfig | None = None) -> None:
        self.config = config or ProfilerConfig()
        self.windows = parse_windows(self.config.steps)
        self.on_finding = self.config.on_finding
        self.starts = {a - 1: (a, b) for a, b in self.windows}  # boundary before the window -> window
        self.ctx: RankContext | None = None
        self.prof: Any = None
        self.window: tuple[int, int] | None = None
        self.current = 1
        self.fired = False  # this rank wrote a trigger
        self.seen = False  # a trigger was read from the store (by every rank, this one included)
        self.store: Any = None
        self.next_look = CHECK_EVERY
        """The first step whose boundary looks for a triggered window (every CHECK_EVERY steps)."""

    def attach(self, ctx: RankContext) -> None:
        self.ctx = ctx
        if self.on_finding > 0:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                try:
                    self.store = dist.distributed_c10d._get_default_store()
                except Exception:  # no store (a fake group): triggered windows stay off
                    self.store = None
            ctx.finding_listeners.append(self._on_finding)

    def _on_finding(self, finding: Finding) -> None:
        """Called from any thread for every finding of this rank."""
        if (self.fired or self.seen or self.store is None or finding.detector not in TRIGGERS
                or Severity(finding.severity).order < Severity.WARNING.order):
            return
        self.fired = True
        start = (self.current + CHECK_EVERY + 1 + CHECK_EVERY - 1) // CHECK_EVERY * CHECK_EVERY
        try:
            self.store.set(STORE_KEY, f"{start}:{start + self.on_finding - 1}:{finding.detector}")
        except Exception:  # the store went away (job ending): no window
            pass

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        self.current = event.step + 1
        if self.prof is not None:
            assert self.window is not None
            if event.step >= self.window[1]:
                self._stop()
            else:
                self.prof.step()
        if self.store is not None and event.step >= self.next_look and not self.seen:
            self.next_look = (event.step // CHECK_EVERY + 1) * CHECK_EVERY
            self._look_for_trigger(event.step)
        # A window whose boundary was an off step of --measure-overhead (no detector called) starts at the next
        # boundary seen, for the steps it still covers.
        for before in sorted(k for k in self.starts if k <= event.step):
            a, b = self.starts.pop(before)
            if self.prof is None and b > event.step:
                self._start((max(a, event.step + 1), b))
        return ()

    def _look_for_trigger(self, step: int) -> None:
        """A triggered window in the store (written by any rank): schedule it on this rank."""
        try:
            if not self.store.check([STORE_KEY]):
                return
            a, b, _ = self.store.get(STORE_KEY).decode().split(":", 2)
        except Exception:  # the store went away (job ending)
            return
        self.seen = True
        start, end = int(a), int(b)
        if start - 1 >= step:
            self.starts[start - 1] = (start, end)

    def _start(self, window: tuple[int, int]) -> None:
        with self.one_off(PROFILER_WINDOW, count=False, opens=1):  # a window's price, paid once: not the per-step cost
            self._start_window(window)

    def _stop(self) -> None:
        with self.one_off(PROFILER_WINDOW, opens=-1):
            self._stop_window()

    def _start_window(self, window: tuple[int, int]) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities)
        prof.record_steps = True  # ProfilerStep#N marks, as with a schedule
        prof.step_num = window[0]
        with _without_profiler_chatter():
            prof.start()
        self.prof, self.window = prof, window

    def _stop_window(self) -> None:
        prof, planned = self.prof, self.window
        self.prof, self.window = None, None
        assert planned is not None
        # The steps that ended inside the window. At a step's end torch's profiler closes its mark and
        # opens the next one at once, so a job that ends (returns or raises) inside a window leaves a
        # last mark that is no step: what ran after the last step's end (a save, destroy_process_group,
        # the rest of the script) or the unfinished step that raised. The trace says which marks are
        # steps; the analysis reads only those (analysis.traces).
        last = min(planned[1], self.current - 1)
        steps = [planned[0], last] if last >= planned[0] else []
        try:
            prof.add_metadata_json(layout.TRACE_WINDOW_KEY, json.dumps({"planned": list(planned), "steps": steps}))
        except Exception:  # the analysis falls back on the directory's name
            pass
        with _without_profiler_chatter():
            prof.stop()
        # Named for the steps it covers: a script that ends inside a window ran only some of them
        # (one that ends inside the first step keeps the first step's name; its record says none).
        window = (planned[0], max(planned[0], last))
        if self.ctx is not None and self.ctx.run_dir is not None:
            out = trace_dir(Path(self.ctx.run_dir), *window)
            out.mkdir(parents=True, exist_ok=True)
            path = layout.trace_path(Path(self.ctx.run_dir), *window, self.ctx.rank)
            prof.export_chrome_trace(str(path))
            self.ctx.emit(schema.TRACE, steps=list(window), complete=steps, path=str(path))

    def on_end(self) -> Iterable[Finding]:
        if self.prof is not None:  # the script ended inside a window: keep what it has
            self._stop()
        return ()

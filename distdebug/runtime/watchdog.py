"""The rank's watchdog thread: notices a stall and records what the rank was doing; ends orphans.

Why a thread inside the rank: when a job hangs, every rank's main thread is blocked (inside a
collective, a sleep, a dead data loader). A daemon thread still runs (gloo and NCCL waits release
the GIL), so it can read ``sys._current_frames()`` and PyTorch's Flight Recorder buffer, and write
them to the run directory, with no help from the launcher or the other ranks. The launcher's
supervisor reads those records and decides.

The thread wakes every ``interval`` seconds and reads the rank's progress record
(``runtime.progress``), nothing else of the session: its cost to training is nil.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distdebug import envvars
from distdebug.artifacts import layout, schema
from distdebug.findings import Severity
from distdebug.runtime.wake import WakePipe

if TYPE_CHECKING:
    from distdebug.runtime.progress import Progress
    from distdebug.runtime.session import Session


def frames_of(stack: traceback.StackSummary) -> list[dict[str, Any]]:
    """JSON-ready frames (file, line, func, code), innermost last, as stall and error records store them."""
    return [{"file": f.filename, "line": f.lineno, "func": f.name, "code": (f.line or "").strip()} for f in stack]


def other_threads() -> list[tuple[int, str, bool, traceback.StackSummary]]:
    """(ident, name, is the main thread, stack) of every thread but the caller's, the main thread first.
    Read from another thread while the main one is blocked in C code (a collective's wait, a sleep, a
    data loader's queue): those release the GIL, and their Python frames stay where they called in."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    me = threading.get_ident()
    out = [(ident, names.get(ident, "?"), ident == main_id, traceback.extract_stack(frame))
           for ident, frame in sys._current_frames().items() if ident != me]
    return sorted(out, key=lambda t: not t[2])


def thread_stacks() -> tuple[str, list[dict[str, Any]]]:
    """All threads' Python stacks as text, and the main thread's as structured frames (innermost last)."""
    parts: list[str] = []
    main_frames: list[dict[str, Any]] = []
    for ident, name, main, stack in other_threads():
        parts.append(f'Thread "{name}" ({ident}){" [main]" if main else ""}:\n')
        parts.extend(traceback.format_list(stack))
        parts.append("\n")
        if main:
            main_frames = frames_of(stack)
    return "".join(parts), main_frames


def flight_recorder_dump() -> bytes | None:
    """PyTorch's Flight Recorder buffer (torch's pickle format), or None if unavailable here."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        from torch._C import _distributed_c10d as c10d

        data = c10d._dump_fr_trace(True, True)  # type: ignore[attr-defined]
        return data if isinstance(data, bytes) and data else None
    except Exception:
        return None


def _in_collective(p: Progress) -> dict[str, Any] | None:
    """The collective the training thread is inside now (a copy), with how long it has waited there."""
    current = p.in_collective
    if not current:
        return None
    out = dict(current)
    out["waiting_s"] = round(time.monotonic() - out.pop("since"), 3)
    return out


CLEARED, STALLED, STILL_STALLED = "cleared", "stalled", "still-stalled"


class StallClock:
    """The watchdog's decisions, on the times it is given (pure, no clock of its own: unit-tested).

    A stall is the rank's last progress older than ``timeout`` seconds; it is recorded once
    (STALLED), recorded again each further ``timeout`` while nothing moves (STILL_STALLED: fresh
    stacks, so that the launcher sees what changed: a busy rank that now waits for another is a
    hang; one still busy, a warning again, at most once per stall timeout), and CLEARED as soon as
    the progress time moves.
    """

    def __init__(self, timeout: float, startup: float | None = None) -> None:
        self.timeout = timeout
        self.startup = startup if startup is not None else timeout
        """The timeout before the rank's first step has finished (start-up: ranks start unevenly; a rank
        that waits in the first collective for one still building its model has not stalled)."""
        self.stalled_at: float | None = None
        """The progress time (monotonic seconds) of the stall already recorded, or None."""
        self.recorded_at = 0.0
        """When (monotonic seconds) that stall was last recorded."""

    def check(self, progress: float, now: float, started: bool = True) -> list[str]:
        """Actions for one check, in order: progress is the monotonic time of the rank's last progress;
        started: the rank has finished a step (before that, the start-up timeout applies)."""
        actions: list[str] = []
        timeout = self.timeout if started else self.startup
        if self.stalled_at is not None and progress != self.stalled_at:
            actions.append(CLEARED)
            self.stalled_at = None
        if self.stalled_at is None and now - progress > timeout:
            self.stalled_at, self.recorded_at = progress, now
            actions.append(STALLED)
        elif self.stalled_at is not None and now - self.recorded_at > timeout:
            self.recorded_at = now
            actions.append(STILL_STALLED)
        return actions


class RankWatchdog:
    def __init__(self, session: Session, stall_timeout: float, *, startup_timeout: float | None = None,
                 watch_parent: bool = True, interval: float = 0.5):
        self.session = session
        self.stall_timeout = stall_timeout
        self.watch_parent = watch_parent
        self.interval = interval
        self.parent = os.getppid()
        self.clock = StallClock(stall_timeout, startup_timeout)
        self._request_seen: int | None = None  # the stacks request last answered (its file's mtime)
        self.request_checks = 0
        """How many times this rank looked at the run directory's request file: once at start and once a
        request with its launcher's relay (runtime.wake); twice a second without."""
        self._wake: WakePipe | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        folder = envvars.get(envvars.WAKE_DIR)
        if folder:
            try:
                self._wake = WakePipe(Path(folder), self.session.identity.rank)
            except OSError:  # no pipe: the rank polls the request file
                self._wake = None
        self._thread = threading.Thread(target=self._loop, name="distdebug-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """After the script: no thread of ours is left running into interpreter teardown."""
        self._stop.set()
        if self._wake is not None:
            self._wake.poke()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)
        if self._wake is not None and (self._thread is None or not self._thread.is_alive()):
            self._wake.close()

    def _loop(self) -> None:
        asked = True  # a request made before this rank's pipe existed is looked for once
        while not self._stop.is_set():
            if asked or self._wake is None:
                try:
                    self.answer_stacks()
                except Exception:  # a request it could not answer: distdebug stacks says the rank did not answer
                    pass
            if self._wake is not None:
                try:
                    asked = self._wake.wait(self.interval)
                except Exception:  # a broken pipe never ends the stall checks: back to polling
                    self._wake = None
                    asked = True
            elif self._stop.wait(self.interval):
                break
            if self._stop.is_set():
                break
            try:
                self.check()
            except Exception as e:  # the watchdog must never take the rank down; it keeps watching
                try:
                    print(f"distdebug: watchdog error on rank {self.session.identity.rank}: {e}", file=sys.stderr)
                except Exception:
                    pass

    def check(self) -> None:
        s = self.session
        if self.watch_parent and os.getppid() != self.parent:
            # Workers run in sessions of their own: a SIGKILLed launcher would leave them running.
            try:
                s.harness_finding(Severity.CRITICAL, "launcher",
                                   "the launcher process died; ending this rank so that it is not left behind")
            finally:  # even if saying so fails (stderr may be a pipe nobody reads any more)
                if self._wake is not None:  # its pipe, and the launcher's folder once empty (runtime.wake)
                    self._wake.close()
                os._exit(137)
        if self.stall_timeout <= 0:
            return
        p = s.progress
        last, now = p.last, time.monotonic()
        for action in self.clock.check(last, now, started=p.step > 0):
            if action == CLEARED:
                s.emit(schema.record(schema.STALL_CLEARED, rank=s.identity.rank, step=p.step, time=time.time()))
            else:
                self.record_stall(now - last)

    def answer_stacks(self) -> None:
        """``distdebug stacks``: when its request file is new (one stat a wake-up, nothing else while none
        comes), write every thread's stack with the rank's step, phase and collective in flight to the
        rank's answer file (written aside and renamed: a reader never sees half of it). From this thread,
        so the answer comes while the training thread is blocked, and the training is not stopped."""
        run_dir = self.session.ctx.run_dir
        if run_dir is None:
            return
        request = layout.stacks_request_path(run_dir)
        self.request_checks += 1
        try:
            stamp = request.stat().st_mtime_ns
        except OSError:
            return
        if stamp == self._request_seen:
            return
        self._request_seen = stamp
        import json

        from distdebug.artifacts.writer import write_json_atomic

        try:
            asked = json.loads(request.read_text()).get("id")
        except (OSError, ValueError, AttributeError):
            return
        s, p = self.session, self.session.progress
        threads = [{"name": name, "ident": ident, "main": main, "frames": frames_of(stack)}
                   for ident, name, main, stack in other_threads()]
        answer = {"request": asked, "rank": s.identity.rank, "host": s.identity.host, "pid": s.identity.pid,
                  "time": time.time(), "step": p.step, "phase": p.phase, "in_collective": _in_collective(p),
                  "idle_s": round(time.monotonic() - p.last, 3), "threads": threads,
                  "request_checks": self.request_checks, "woken": self._wake is not None}
        write_json_atomic(layout.stacks_answer_path(run_dir, s.identity.rank), answer)  # secrets redacted

    def record_stall(self, idle: float) -> None:
        s = self.session
        text, main_frames = thread_stacks()
        fr = flight_recorder_dump()
        run_dir = s.ctx.run_dir
        if run_dir is not None:
            try:  # a full disk loses the files, never the stall record below (the hang verdict reads it)
                layout.rank_dir(run_dir, s.identity.rank).mkdir(parents=True, exist_ok=True)
                from distdebug.artifacts.redact import Redactor

                layout.stacks_path(run_dir, s.identity.rank).write_text(Redactor()(text))
                if fr is not None:
                    layout.fr_trace_path(run_dir, s.identity.rank).write_bytes(fr)
            except OSError:
                fr = None
        p = s.progress
        s.emit(schema.record(
            schema.STALL, rank=s.identity.rank, step=p.step, phase=p.phase, idle_s=round(idle, 3),
            collectives_entered=p.collective_seq, in_collective=_in_collective(p), main_stack=main_frames,
            flight_recorder=fr is not None, time=time.time(),
        ))

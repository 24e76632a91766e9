"""The log-volume guard: during the job's first minutes, what this node writes an hour and where, against
the free space there (issue 48, item 6; the model is ``doctor.volume``).

Why measured and not only predicted: what fills a disk is mostly written by others (a script's prints
into the Slurm output file, NCCL's per-collective lines, torchrun's log folder), and its rate depends on
the step rate, known only once the job runs. So the launcher, which holds the files the ranks write to
(its own stdout and stderr are theirs unless torchrun redirects them), measures how much each
destination grew over a window after every local rank finished its second step (start-up's one-off
lines apart), predicts per-collective lines from the collectives counted where the log cannot be
measured (a pipe, a terminal), and computes the hours until each file system is full
(``doctor.volume.fill_hours``; the run directory stops at its budget). Shorter than what is left of
the job's expected length: a warning finding with the numbers and the fix, once per file system, at
the end of the window or at a later look (every ``VOLUME_RECHECK_S``). At the end of the job the
prediction is set beside what was written since (the node's file, the report): a guard whose
prediction is not checked is a guess.

Cost: a stat of each local rank's files (about 14 a rank) and of each log destination, three times in
the first minutes and once every ten minutes; records are fed by the supervisor's reads, nothing is
read twice. Its looks run on a thread of their own (``distdebug-volume``): a destination on a file system
that hangs (an NFS server gone) stops the guard, never the supervisor's hang detection. Any error of its
own turns it off, never the job.
"""

from __future__ import annotations

import glob
import math
import os
import socket
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distdebug.analysis.volume import Part, fill_finding, unmeasured_finding
from distdebug.artifacts import layout, schema
from distdebug.doctor.volume import env_logs, fill_hours, free_bytes, hours_text, mount_point, nccl_file
from distdebug.findings import Finding

START_FALLBACK_S = 600.0
"""Seconds after the launch when the window starts even if no step was seen (a script whose steps are not
found still prints): long enough that start-up's output (compilation, a checkpoint's load, NCCL's init
lines) is not taken for a rate."""
ONE_GIB = 1 << 30


@dataclass
class Destination:
    key: str
    label: str
    path: str
    files: list[str]
    """Files to stat (a pattern for NCCL_DEBUG_FILE is globbed at each look)."""
    fd: int | None = None
    """The launcher's own stdout or stderr: fstat'd (its name may be deleted)."""
    walk: bool = False
    """A folder whose every file counts (torchrun's --log-dir)."""

    def size(self) -> int:
        if self.fd is not None:
            try:
                return os.fstat(self.fd).st_size
            except OSError:
                return 0
        paths: list[str] = []
        if self.walk:
            for root, _, names in os.walk(self.path):
                paths += [os.path.join(root, n) for n in names]
        else:
            for f in self.files:
                paths += glob.glob(f) if glob.has_magic(f) else [f]
        total = 0
        for p in paths:
            try:
                total += os.stat(p).st_size
            except OSError:  # rotated, thinned or deleted between the listing and the stat
                pass
        return total


def _seconds(text: str | None, default: float) -> float:
    """DISTDEBUG_VOLUME_WINDOW_S: a positive number of seconds, else the default (never an error at launch)."""
    try:
        value = float(text) if text else default
    except ValueError:
        return default
    return value if value > 0 else default


def _descendant(start: dict[str, Any]) -> bool:
    """Whether a START record's process is one of this launcher's (torch's agent's workers are its children)."""
    import psutil

    try:
        return int(start.get("pid") or -1) in {p.pid for p in psutil.Process().children(recursive=True)}
    except (psutil.Error, ValueError):
        return start.get("host") == socket.gethostname()


def expected_hours(given: float | None, env: dict[str, str], now: float) -> tuple[float, str]:
    """(hours the job is expected to run from now, where that comes from)."""
    from distdebug.config import EXPECTED_HOURS

    if given is not None:
        return given, "--expected-hours"
    end = env.get("SLURM_JOB_END_TIME")
    if end and end.strip().isdigit() and int(end) > now:
        return (int(end) - now) / 3600, "Slurm's end time for this job"
    return EXPECTED_HOURS, f"the default {EXPECTED_HOURS:g} hours; --expected-hours to say"


def std_streams() -> list[Destination]:
    """The launcher's stdout and stderr where they are regular files (a batch job's output file), once each:
    the ranks write to the same files unless torchrun redirects them."""
    out: list[Destination] = []
    seen: set[tuple[int, int]] = set()
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = name
        both = " and stderr" if name == "stdout" and _same(1, 2) else ""
        out.append(Destination(name, f"{name}{both} ({path})", path, [], fd=fd))
    return out


def _same(a: int, b: int) -> bool:
    try:
        x, y = os.fstat(a), os.fstat(b)
        return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)
    except OSError:
        return False


class VolumeGuard:
    def __init__(self, run_dir: Path, *, budget: int, expected: float | None, log_dir: str | None,
                 env: dict[str, str] | None = None, window_s: float | None = None, recheck_s: float | None = None,
                 host: str | None = None, clock: Any = time.monotonic,
                 streams: list[Destination] | None = None, node_rank: int = 0,
                 is_local: Any = None) -> None:
        """log_dir: torchrun's --log-dir as torch's launcher parsed it. streams: the launcher's own output files
        (None: ``std_streams()``; tests give their own). is_local:
        whether a rank's START record is one of this agent's ranks (None: its pid is a descendant of this
        process; by host name it would take another agent's ranks on the same host for its own)."""
        from distdebug import envvars
        from distdebug.config import VOLUME_RECHECK_S, VOLUME_WINDOW_S

        self.run_dir = run_dir
        self.budget = budget
        self.env = dict(os.environ) if env is None else env
        self.expected, self.expected_source = expected_hours(expected, self.env, time.time())
        self.window_s = window_s if window_s is not None else _seconds(self.env.get(envvars.VOLUME_WINDOW),
                                                                       VOLUME_WINDOW_S)
        self.recheck_s = recheck_s if recheck_s is not None else VOLUME_RECHECK_S
        self.host = host or socket.gethostname()
        self.node_rank = node_rank
        self.is_local = is_local or _descendant
        self.clock = clock
        self.started = clock()
        self.local: frozenset[int] = frozenset()
        """This launcher's ranks; replaced whole, never changed in place: ``feed`` runs on the supervisor's thread
        and the looks on the guard's own, which iterates it."""
        self.last_step: dict[int, int] = {}
        self.collectives = 0
        """Collectives the local ranks entered in steps finished since the window started."""
        self.logs = env_logs(self.env)
        self.dests = self._destinations(log_dir, std_streams() if streams is None else streams)
        self.t0: float | None = None
        self.t1: float | None = None
        self.sizes0: dict[str, int] = {}
        self.sizes1: dict[str, int] = {}
        self.sizes_last: dict[str, int] = {}
        self.rates: dict[str, float] = {}
        """Destination -> bytes an hour measured over the window (the prediction)."""
        self.predicted: dict[str, float] = {}
        """Per-collective lines predicted where they cannot be measured: label -> bytes an hour."""
        self.fills: dict[str, dict[str, Any]] = {}
        self.warned: set[str] = set()
        self.findings: list[Finding] = []
        self.last_look = 0.0
        self.ending: float | None = None
        """When the first local rank ended (its END record read)."""
        self.final: tuple[float, dict[str, int]] | None = None
        """(when, sizes) at the first look after that: what the prediction is compared with."""
        self.off: str | None = None

    def _destinations(self, log_dir: str | None, streams: list[Destination]) -> list[Destination]:
        out = [Destination("run", "run directory", str(self.run_dir), [])]
        out += streams
        if log_dir:
            out.append(Destination("log_dir", f"torchrun's --log-dir ({log_dir})", log_dir, [], walk=True))
        for log in self.logs:
            if log.target not in ("stdout", "stderr"):
                pattern = nccl_file(log.target, self.host.split(".")[0])  # NCCL's %h: the short host name
                out.append(Destination("nccl_file", f"NCCL_DEBUG_FILE ({log.target})", os.path.dirname(pattern)
                                       or ".", [pattern]))
        return out

    # ------------------------------------------------------------------ fed by the supervisor's reads
    def feed(self, rank: int, rec: dict[str, Any]) -> None:
        if self.off:
            return
        try:
            self._feed(rank, rec)
        except Exception as e:  # its errors turn the guard off, never the supervisor's hang detection
            self._turn_off(e)

    def _feed(self, rank: int, rec: dict[str, Any]) -> None:
        kind = rec.get("kind")
        if kind == schema.START:
            if rank in self.local or self.is_local(rec):
                self.local = self.local | {rank}
                self.last_step[rank] = 0
                if self.ending is not None:  # a restarted attempt (--max-restarts): the job goes on
                    self.ending = self.final = None
                    if self.t1 is None:
                        self.t0 = None  # its window starts again after the new attempt's second step
        elif kind == schema.STEP and rank in self.local:
            self.last_step[rank] = int(rec.get("step") or 0)
            if self.t0 is not None and self.t1 is None:
                self.collectives += int(rec.get("collectives") or 0)
        elif kind in (schema.END, schema.SCRIPT_ERROR) and rank in self.local and self.ending is None:
            self.ending = self.clock()  # the steady part is over: the next look is the last that compares

    # ------------------------------------------------------------------ looks
    def _sizes(self) -> dict[str, int]:
        out = {}
        for d in self.dests:
            if d.key == "run":
                files: list[str] = []
                for rank in sorted(self.local):
                    folder = layout.rank_dir(self.run_dir, rank)
                    try:  # not the writers' held-back reserves (made before, released at the end) nor the files
                        # replaced whole (the readers' index, bounded): never a rate
                        files += [str(p) for p in folder.iterdir()
                                  if not p.name.endswith(".reserve") and p.name not in layout.REWRITTEN]
                    except OSError:
                        pass
                if self.node_rank == 0:  # the profiler's windows: one folder for every rank
                    for root, _, names in os.walk(layout.traces_root(self.run_dir)):
                        files += [os.path.join(root, n) for n in names]
                d.files = files
            out[d.key] = d.size()
        return out

    def poll(self) -> list[Finding]:
        """One look; the findings it makes (also kept in ``findings``)."""
        if self.off:
            return []
        try:
            return self._poll(self.clock())
        except Exception as e:  # the guard must never take the job (or the hang detection) down
            self._turn_off(e)
            return []

    def _turn_off(self, e: Exception) -> None:
        self.off = f"{type(e).__name__}: {e}"
        print(f"distdebug: log-volume guard error (guard off): {self.off}", file=sys.stderr, flush=True)

    def _poll(self, now: float) -> list[Finding]:
        if self.ending is not None:
            if self.t1 is not None and self.final is None:
                self.final = (now, self._sizes())
            return []
        if self.t0 is None:
            ready = bool(self.local) and all(self.last_step.get(r, 0) >= 2 for r in self.local)
            if ready or now - self.started >= START_FALLBACK_S:
                self.t0, self.sizes0 = now, self._sizes()
            return []
        if self.t1 is None:
            if now - self.t0 < self.window_s:
                return []
            self.t1, self.sizes1 = now, self._sizes()
            self.last_look, self.sizes_last = now, self.sizes1
            hours = (now - self.t0) / 3600
            self.rates = {k: max(0.0, (self.sizes1[k] - self.sizes0.get(k, 0)) / hours) for k in self.sizes1}
            per_s = self.collectives / (now - self.t0)
            measured_stdout = any(d.key in ("stdout", "stderr") for d in self.dests)
            out = []
            for log in self.logs:
                if log.per_collective and log.target in ("stdout", "stderr") and not measured_stdout:
                    rate = self.predicted[log.setting] = log.per_collective * per_s * 3600
                    out.append(unmeasured_finding(
                        log=log, bytes_per_hour=rate, collectives_per_s=per_s, hours_left=self._left(now),
                        expected_source=self.expected_source, ranks=sorted(self.local), step=self._step()))
            self.findings += out
            return out + self._judge(now, self.rates, f"over the first {self.window_s:g} s of steps")
        if now - self.last_look < self.recheck_s:
            return []
        sizes = self._sizes()
        # since the window: one burst (an evaluation's dump) is averaged over the job so far, not extrapolated
        hours = (now - self.t1) / 3600
        rates = {k: max(0.0, (sizes[k] - self.sizes1.get(k, 0)) / hours) for k in sizes}
        self.last_look, self.sizes_last = now, sizes
        return self._judge(now, rates, f"over the {hours_text(hours)} since its first minute of steps")

    def _left(self, now: float) -> float:
        return max(0.0, self.expected - (now - self.started) / 3600)

    def _step(self) -> int | None:
        steps = [self.last_step.get(r, 0) for r in self.local]
        return min(steps) if steps else None

    def _sharing(self) -> int:
        """Nodes writing into this run directory (a shared file system): their node files are here."""
        return max(1, len(layout.node_files(self.run_dir)))

    def _judge(self, now: float, rates: dict[str, float], over: str) -> list[Finding]:
        by_device: dict[int, list[tuple[Destination, float, float | None]]] = {}
        free_of: dict[int, tuple[int, str]] = {}
        sharing = self._sharing()
        for d in self.dests:
            where = free_bytes(d.path)
            if where is None:
                continue
            free, dev = where
            rate, cap = rates.get(d.key, 0.0), None
            if d.key == "run":
                rate *= sharing
                if self.budget > 0:
                    used = self.sizes_last.get("run", 0) * sharing
                    cap = max(0.0, self.budget * max(1, len(self.local)) * sharing - used)
            by_device.setdefault(dev, []).append((d, rate, cap))
            free_of[dev] = (free, mount_point(d.path))
        if sharing > 1 and self.node_rank != 0:  # a shared run directory's file system: node 0 says it, once
            run_dev = next((dev for dev, parts in by_device.items() if any(d.key == "run" for d, _, _ in parts)), None)
            by_device.pop(run_dev, None)  # type: ignore[arg-type]
        left = self._left(now)
        out: list[Finding] = []
        for dev, parts in by_device.items():
            free, mp = free_of[dev]
            h = fill_hours(free, [(r, c) for _, r, c in parts])
            self.fills[mp] = {"free_bytes": free, "hours_to_fill": None if math.isinf(h) else h,
                              "bytes_per_hour": sum(r for _, r, _ in parts)}
            if h >= left or mp in self.warned:
                continue
            self.warned.add(mp)
            out.append(fill_finding(
                mount=mp, free=free, hours=h, hours_left=left, logs=self.logs, budget=self.budget,
                parts=[Part(d.key, d.label, r, c) for d, r, c in parts], over=over,
                expected_source=self.expected_source, ranks=sorted(self.local), step=self._step()))
        self.findings += out
        return out

    # ------------------------------------------------------------------ the end
    def summary_within(self, seconds: float) -> dict[str, Any] | None:
        """``summary()``, or a line saying why not when a destination does not answer within ``seconds`` (a
        hung file system must not keep attach from returning the job's exit code)."""
        import threading

        out: list[dict[str, Any] | None] = []
        worker = threading.Thread(target=lambda: out.append(self.summary()), name="distdebug-volume-end", daemon=True)
        worker.start()
        worker.join(seconds)
        return out[0] if out else {"measured": False, "why": f"a destination did not answer within {seconds:g} s"}

    def summary(self) -> dict[str, Any] | None:
        """For the node's file: the prediction beside what was written since it (None: no window ended)."""
        if self.t1 is None:
            return {"measured": False, "why": self.off or "the job ended before the window did"}
        try:
            return self._summary()
        except Exception as e:  # never the job's exit
            return {"measured": False, "why": f"{type(e).__name__}: {e}"}

    def _summary(self) -> dict[str, Any]:
        assert self.t1 is not None
        now, sizes = self.final or (self.clock(), self._sizes())
        seconds = now - self.t1
        dests = []
        for d in self.dests:
            written = (sizes.get(d.key, 0) - self.sizes1.get(d.key, 0)) / (seconds / 3600) if seconds > 0 else None
            dests.append({"key": d.key, "label": d.label, "predicted_bytes_per_hour": round(self.rates.get(d.key, 0)),
                          "written_bytes_per_hour": None if written is None else round(written)})
        return {"measured": True, "window_s": round(self.t1 - (self.t0 or self.t1), 3),
                "seconds_after": round(seconds, 3), "expected_hours": round(self.expected, 3),
                "expected_source": self.expected_source, "destinations": dests,
                "predicted_lines": {k: round(v) for k, v in self.predicted.items()},
                "file_systems": self.fills, "warned": sorted(self.warned)}

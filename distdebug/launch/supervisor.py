"""The launcher's supervisor: turns ranks' stall records into a hang verdict, then ends the job.

Runs as a thread in the ``distdebug attach`` process while torch's elastic agent runs the ranks
in the main thread. It tails the ranks' append-only event streams (only new bytes each poll).
Each rank's own watchdog records a stall with its stacks and Flight Recorder dump; once every
live rank on this node has stalled (or a grace period passed), the supervisor diagnoses
(``analysis.hang``), writes the verdict to ``findings.jsonl``, prints it, and, unless told only
to report, kills this node's ranks by pid so that torch's agent tears the job down.

No kill without a culprit: a diagnosis that names none (every rank busy in its own work, e.g. a
long evaluation) is a warning with every rank's stack, and the job goes on; the ranks' watchdogs
record the stall again after each further stall timeout (before a rank's first step: each further
start-up allowance), so the warning repeats at most once per timeout, and a stall that turns into a
real hang (a rank now waits for another) is then diagnosed and ended. ``--on-stall abort`` ends the
job on such a stall too.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distdebug.artifacts import layout, schema
from distdebug.artifacts.reader import Follow
from distdebug.artifacts.writer import append_run_findings, os_error_text
from distdebug.findings import Finding
from distdebug.report.fmt import format_finding

if TYPE_CHECKING:
    from distdebug.launch.volume import VolumeGuard

GRACE_S = 5.0
"""After the first stall record, how long to wait for the other ranks' dumps before diagnosing."""
RETRY_S = 2.0
"""After a diagnosis that named no culprit while some rank had not stalled yet: when to look again."""


WAIT, RENDEZVOUS_HANG, DIAGNOSE_ALL, DIAGNOSE_SOME = "wait", "rendezvous-hang", "diagnose-all", "diagnose-some"
RETRY, WARN, REPORT, END_JOB = "retry", "warn", "report", "end-job"


def poll_decision(*, now: float, started: float, stall_timeout: float, pids: set[int], stalled: dict[int, float],
                  ended: set[int], heard: dict[int, float], retry_at: float, has_children: Callable[[], bool],
                  startup_timeout: float | None = None) -> str:
    """What the supervisor does at one poll (pure; times are monotonic seconds; unit-tested).

    startup_timeout: how long a rendezvous may take (as a rank's start-up: nodes start unevenly;
    None: the stall timeout); pids: the ranks that wrote a start record; stalled: rank -> when its
    stall record arrived; ended: ranks that ended or raised; heard: rank -> when its last record of any
    kind arrived. Returns WAIT, RENDEZVOUS_HANG (no rank started within the start-up allowance after
    the launch and no worker exists), DIAGNOSE_ALL
    (every live rank has stalled) or DIAGNOSE_SOME (the grace period is over and the ranks that have not
    stalled are silent too).
    """
    if not pids:
        # Rendezvous is done once torch's agent has started this node's workers (they may take a
        # while to import torch and write their first record; that is not a rendezvous hang).
        if now - started > (startup_timeout or stall_timeout) and not has_children():
            return RENDEZVOUS_HANG
        return WAIT
    if not stalled or now < retry_at:
        return WAIT
    live = pids - ended
    if live <= set(stalled):
        return DIAGNOSE_ALL
    # A rank that has not stalled is waited for while it keeps writing records (a slow rank makes
    # progress: no kill without a culprit); one silent for a whole stall timeout without a stall
    # record of its own (its watchdog could not run: a native hang holding the GIL, a stopped
    # process) is no longer waited for once the grace period is over.
    waited = now - min(stalled.values())
    silent = all(now - heard.get(r, started) > stall_timeout for r in live - set(stalled))
    return DIAGNOSE_SOME if waited > GRACE_S and silent else WAIT


def verdict_decision(*, busy: bool, every: bool, on_stall: str, on_hang: str) -> str:
    """What follows a diagnosis (pure; unit-tested): the job is never ended without a culprit.

    busy: the diagnosis named no culprit (every stalled rank busy in its own work); every: every live
    rank had a stall record. Returns RETRY (no culprit yet while some rank has not stalled: a rank still
    silent may yet show one), WARN (no culprit: say so with the stacks, the job goes on), REPORT (a
    verdict, the job kept: ``--on-hang report``) or END_JOB (a verdict, this node's ranks ended).
    """
    if busy:
        if not every:
            return RETRY
        if on_stall != "abort":
            return WARN
    return END_JOB if on_hang == "abort" else REPORT


class Supervisor:
    def __init__(self, run_dir: Path, *, stall_timeout: float, on_hang: str, node_rank: int, expected_nodes: int,
                 interval: float = 0.5, on_stall: str = "warn", startup_timeout: float | None = None,
                 guard: VolumeGuard | None = None) -> None:
        self.run_dir = run_dir
        self.stall_timeout = stall_timeout
        self.startup_timeout = startup_timeout or stall_timeout
        self.on_hang = on_hang
        self.on_stall = on_stall
        self.stall_warnings = 0
        self.node_rank = node_rank
        self.expected_nodes = expected_nodes
        self.interval = interval
        self.started = time.monotonic()
        self.verdict: list[Finding] | None = None
        self._tails: dict[int, Follow] = {}
        self._pids: dict[int, int] = {}
        self._host: dict[int, str] = {}
        self._stalled: dict[int, float] = {}
        self._ended: set[int] = set()
        self._stall_step: dict[int, Any] = {}  # rank -> steps it had finished at its last stall record
        self._heard: dict[int, float] = {}
        """rank -> when its last record arrived (a step, a finding, anything: the rank is alive)."""
        self._reported = False
        self._retry_at = 0.0  # after a diagnosis that had to wait for more stall records
        self.guard = guard
        """The log-volume guard (launch.volume): fed the records read here, looks from this thread."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="distdebug-supervisor", daemon=True)
        self._guard_thread = threading.Thread(target=self._guard_loop, name="distdebug-volume", daemon=True)

    def start(self) -> None:
        if self.stall_timeout > 0 or self.guard is not None:
            self._thread.start()
        if self.guard is not None:
            self._guard_thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._guard_thread.is_alive():
            self._guard_thread.join(timeout=2)  # a look stuck on a hung file system is left behind (a daemon)

    # ------------------------------------------------------------------ polling
    def _loop(self) -> None:
        watching = self.stall_timeout > 0
        while not self._stop.wait(self.interval):
            if watching:
                try:
                    self.poll()
                except Exception as e:  # the supervisor must never take the job down
                    print(f"distdebug: supervisor error (hang detection off): {type(e).__name__}: {e}",
                          file=sys.stderr)
                    watching = False
            else:
                try:
                    self._scan()  # the guard's records still
                except Exception:  # a read that failed: the guard goes without, the job goes on
                    return
            if not watching and (self.guard is None or self.guard.off):
                return

    def _guard_loop(self) -> None:
        """The log-volume guard's looks, on their own thread: a stat that hangs stops the guard alone."""
        assert self.guard is not None
        while not self._stop.wait(self.interval) and not self.guard.off:
            try:
                self._record(self.guard.poll(), say=True)  # its own errors turn only it off
            except Exception:  # writing its warning failed oddly: the warning was printed
                pass

    def _scan(self) -> None:
        for rank, _ in layout.rank_dirs(self.run_dir):
            if rank not in self._tails:
                self._tails[rank] = Follow(layout.events_path(self.run_dir, rank))
        for rank, tail in self._tails.items():
            for rec in tail.read():
                self._heard[rank] = time.monotonic()
                if self.guard is not None:
                    self.guard.feed(rank, rec)
                kind = rec.get("kind")
                if kind == schema.START:
                    self._pids[rank], self._host[rank] = int(rec["pid"]), str(rec.get("host"))
                    self._stalled.pop(rank, None)
                    self._ended.discard(rank)
                elif kind == schema.STALL:
                    self._stalled[rank] = time.monotonic()
                    self._stall_step[rank] = rec.get("step")
                elif kind == schema.STALL_CLEARED:
                    self._stalled.pop(rank, None)
                    self._reported = False
                elif kind in (schema.END, schema.SCRIPT_ERROR):
                    self._ended.add(rank)
                    self._stalled.pop(rank, None)

    def poll(self) -> None:
        self._scan()
        if self._reported:
            return
        action = poll_decision(now=time.monotonic(), started=self.started, stall_timeout=self.stall_timeout,
                               pids=set(self._pids), stalled=self._stalled, ended=self._ended, heard=self._heard,
                               retry_at=self._retry_at, has_children=_has_children,
                               startup_timeout=self.startup_timeout)
        if action == RENDEZVOUS_HANG:
            self._rendezvous_hang()
        elif action in (DIAGNOSE_ALL, DIAGNOSE_SOME):
            self._hang(action == DIAGNOSE_ALL)

    # ------------------------------------------------------------------ verdicts
    def _hang(self, every: bool = True) -> None:
        """Diagnose; end the job only on a verdict with a culprit (see the module's docstring).

        every: every live rank has a stall record. A stall without a culprit is only said once they
        all do (a rank still silent may yet show a culprit); until then it is diagnosed again shortly.
        """
        from distdebug.analysis.hang import diagnose, is_busy_stall, stall_without_culprit
        from distdebug.artifacts.reader import load_run

        findings = diagnose(load_run(self.run_dir))
        if not findings:  # stalled, but nothing to name (e.g. one rank alone idle): a warning, no culprit
            starting = all(not self._stall_step.get(r) for r in self._stalled)  # none had finished a step
            findings = [stall_without_culprit(sorted(self._stalled),
                                              self.startup_timeout if starting else self.stall_timeout)]
        action = verdict_decision(busy=is_busy_stall(findings), every=every, on_stall=self.on_stall,
                                  on_hang=self.on_hang)
        if action == RETRY:
            self._retry_at = time.monotonic() + RETRY_S
        elif action == WARN:
            self._warn(findings)
        else:
            self._conclude(findings)
            if action == END_JOB:
                self._terminate_local_ranks()

    def _warn(self, findings: list[Finding]) -> None:
        """Say it, keep the job: the next stall records (after another stall timeout) are diagnosed anew."""
        self.stall_warnings += 1
        self._record(findings)
        for f in findings:
            print(format_finding(f), file=sys.stderr, flush=True)
        self._stalled.clear()

    def _rendezvous_hang(self) -> None:
        from distdebug.analysis.hang import rendezvous_incomplete

        present = [node for node, _ in layout.node_files(self.run_dir)]
        self._conclude([rendezvous_incomplete(expected_nodes=self.expected_nodes, present=present,
                                              stall_timeout=self.startup_timeout, host=socket.gethostname())])
        if self.on_hang == "abort":
            # No worker exists on this node yet: nothing else to clean up.
            from distdebug.config import EXIT_HANG

            print("distdebug: training failed: rendezvous did not complete", file=sys.stderr, flush=True)
            os._exit(EXIT_HANG)

    def _conclude(self, findings: list[Finding]) -> None:
        self.verdict = findings
        self._reported = True
        self._record(findings)
        for f in findings:
            print(format_finding(f), file=sys.stderr, flush=True)

    def _record(self, findings: list[Finding], say: bool = False) -> None:
        """Into the run's findings file; a full or read-only disk loses the file, never the verdict or the kill
        that follows it (the findings are printed in any case). say: print them here too."""
        if not findings:
            return
        if say:
            for f in findings:
                print(format_finding(f), file=sys.stderr, flush=True)
        try:
            append_run_findings(self.run_dir, findings)
        except OSError as e:
            what = "the log-volume warning" if say else "the hang verdict"
            print(f"distdebug: could not write {what} to the run directory ({os_error_text(e)})",
                  file=sys.stderr, flush=True)

    def _terminate_local_ranks(self) -> None:
        """SIGTERM, then SIGKILL, this node's ranks, by pid (only our own descendants).

        Never waits on them (no waitpid): the ranks are torch's agent's children, and reaping them
        here would make the agent read their exit status as success.
        """
        import psutil

        try:
            mine = {p.pid for p in psutil.Process().children(recursive=True)}
        except psutil.Error:
            mine = set()
        targets = [pid for pid in self._pids.values() if pid in mine]
        for pid in targets:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(_alive(pid) for pid in targets):
            time.sleep(0.1)
        for pid in targets:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _has_children() -> bool:
    import psutil

    try:
        return bool(psutil.Process().children())
    except psutil.Error:
        return True  # when in doubt, never call it a rendezvous hang


def _alive(pid: int) -> bool:
    """Running (not a zombie awaiting its parent's wait), without reaping it."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def summary_line(findings: list[Finding]) -> str:
    f = findings[0]
    ranks = ",".join(map(str, f.ranks))
    return f"hang: {f.subject}" + (f" (rank {ranks})" if ranks else "")



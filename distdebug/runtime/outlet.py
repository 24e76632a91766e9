"""The rank's way out: records into its event stream, findings into it, onto stderr and to the listeners.

One room of the session (``runtime.session``): every finding of the rank, a detector's or the harness's
own, leaves through ``report``; nothing here may raise into the training (a broken stderr, a listener that
fails). Any thread may emit (the exchange's and the watchdog's report here too).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distdebug.artifacts import schema
from distdebug.artifacts.writer import EventWriter
from distdebug.context import RankContext
from distdebug.findings import Finding, Severity


class Outlet:
    """``emit`` a record, ``report`` a finding, ``harness_finding`` one of the harness's own."""

    def __init__(self, ctx: RankContext, writer: EventWriter | None, echo: bool, step_of: Callable[[], int]) -> None:
        self.ctx = ctx
        self.writer = writer
        self.echo = echo
        self.step_of = step_of
        """The step in progress (the session's count): a harness finding's step."""
        self.findings: list[Finding] = []

    def emit(self, rec: dict) -> None:
        """Append one record to this rank's event stream (any thread)."""
        if self.writer is not None:
            self.writer.write(rec)

    def report(self, finding: Finding) -> None:
        rank = self.ctx.identity.rank
        self.findings.append(finding)
        self.emit(schema.record(schema.FINDING, rank=rank, **finding.to_dict()))
        if self.echo:
            step = f" step {finding.step}" if finding.step is not None else ""
            try:
                print(
                    f"distdebug[rank {rank}] {finding.severity.value.upper()}{step} "
                    f"{finding.detector}: {finding.subject}: {finding.message}",
                    file=sys.stderr,
                    flush=True,
                )
            except (OSError, ValueError):  # a closed or broken stderr must not reach the training
                pass
        for listener in list(self.ctx.finding_listeners):
            try:
                listener(finding)
            except Exception:  # a listener must not turn a finding into a failure
                pass

    def harness_finding(self, severity: Severity, subject: str, message: str, *, fix: str | None = None,
                        evidence: dict | None = None) -> None:
        self.report(Finding(
            severity=severity, detector="harness", ranks=[self.ctx.identity.rank],
            step=self.step_of() or None, subject=subject, message=message, evidence=evidence or {}, fix=fix,
        ))

    def detector_failed(self, name: str, e: BaseException, phase: str) -> None:
        """A detector raised and is off on this rank: said once, with where it raised."""
        frames = traceback.extract_tb(e.__traceback__)
        where: Any = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
        self.harness_finding(
            Severity.ERROR,
            f"detector:{name}",
            f"detector '{name}' raised {type(e).__name__}: {e} in {phase} (at {where}); "
            "switched off on this rank (its hooks removed, its patches passed through)",
            evidence={"exception": type(e).__name__, "phase": phase, "where": where},
        )

    def start(self, detectors: list[str]) -> None:
        """The rank's first record: who it is (the launcher's supervisor learns its pid here) and what runs."""
        i = self.ctx.identity
        self.emit(schema.record(
            schema.START, rank=i.rank, local_rank=i.local_rank, world_size=i.world_size,
            local_world_size=i.local_world_size, node=i.node, attempt=i.attempt, host=i.host, pid=i.pid,
            ppid=os.getppid(), time=time.time(), detectors=detectors,
        ))

    def end(self, exit_code: int, steps: int, alive: dict[str, Any], released: list[str]) -> None:
        """The rank's last record; ``alive``: what will meet interpreter teardown (the advice if the process
        aborts after this); ``released``: the destroyed groups' defaults it freed (runtime.teardown)."""
        self.emit(schema.record(
            schema.END, rank=self.ctx.identity.rank, exit_code=exit_code, steps=steps, time=time.time(),
            write_errors=self.writer.failed_writes if self.writer else 0, alive=alive, released_defaults=released[:20],
        ))

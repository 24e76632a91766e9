"""EnvCheck: dangerous NCCL/GLOO/MASTER variables, explained in each rank before the script starts.

Why inside attach: a socket interface that does not exist, or error handling turned off, shows up
later as a raw trace from init_process_group or as a hang; the same checks as ``distdebug doctor``
(``doctor.checks.variable_checks``: no subprocess, no torch) run in ``setup`` of each node's local
rank 0 (torch's launcher hands every rank of a node the launcher's environment unchanged), and every
warn or fail becomes a finding with its fix, written before the script's first line. This is the
only environment check attach makes: one finding per node and variable, one wording, one fix.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from distdebug.cards.env_check import CARD
from distdebug.context import RankContext
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity


class EnvCheck(Detector):
    name = "env_check"
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    def setup(self, ctx: RankContext) -> None:
        from distdebug.doctor.checks import FAIL, PASS, variable_checks

        if ctx.identity.local_rank != 0:
            return  # torch's launcher hands every rank of a node the same environment: one report per node
        for c in variable_checks():
            if c.status == PASS:
                continue
            ctx.report(Finding(
                severity=Severity.ERROR if c.status == FAIL else Severity.WARNING, detector=self.name,
                ranks=[ctx.rank], step=None, subject=c.name, message=c.detail, fix=c.fix or None,
                evidence={"check": c.name, "status": c.status},
            ))

    def on_step(self, event: Any) -> Iterable[Finding]:
        return ()

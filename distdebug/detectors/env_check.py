"""EnvCheck: dangerous NCCL/GLOO variables, explained once per node before any rank starts.

Why in the launcher: a socket interface that does not exist, or error handling turned off, shows up
later as a raw trace from init_process_group or as a hang. The same checks as ``distdebug doctor``
(``doctor.checks.check_variables``: no subprocess, no torch) are made by each node's launcher agent
(``node_findings``, called by ``launch.attach``) before it starts its ranks: torch's launcher hands every
rank of a node the launcher's environment, so one check per node sees what every rank will see.
Every warn or fail becomes a finding with its fix, printed on stderr before the first rank starts (with the
host: on several nodes, which one has the bad variable) and kept in the node's record (``nodes/node-000.json``)
until the job ends; then, filed under the global rank of the node's local rank 0 (``own_first_rank``: only then
has the rendezvous numbered the ranks; on one node, rank 0 even when it was stopped before recording its
start), it is appended to the run's findings (``findings.jsonl``). A launcher
killed before that leaves it in its node file, unfiled, where the reader still finds it.

Made inside a rank (its local rank 0, in ``setup``), as it once was, the line raced the script: a rank that
fails at once (on the very interface this check names) makes torch's agent stop the other ranks, and a
local rank 0 still importing torch was stopped before it could say why.

What a rank still checks: a checked variable whose value changed between the launcher and the rank's
start (``DISTDEBUG_ENV_CHECKED`` holds the values the launcher saw). torch's agent sets
TORCH_NCCL_ASYNC_ERROR_HANDLING where it is unset (a safe value, no finding); an injected fault
(``bad_env``) or a site hook may set something worse. A session no launcher of ours started checks all.
MASTER_ADDR/MASTER_PORT are not checked here: torch's agent sets the ranks' own from its rendezvous, so
the launcher's are not what the ranks use (``distdebug doctor`` checks them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from distdebug import envvars
from distdebug.cards.env_check import CARD
from distdebug.context import RankContext
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity

NAME = "env_check"
PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_")
"""The variables the checks read (``doctor.checks.check_variables``)."""


def checked(env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables the checks read, with their values: what the launcher hands its ranks to compare."""
    env = dict(os.environ) if env is None else env
    return {k: v for k, v in sorted(env.items()) if k.startswith(PREFIXES)}


def node_findings(ranks: list[int], env: dict[str, str] | None = None, only: set[str] | None = None,
                  where: dict[str, Any] | None = None) -> list[Finding]:
    """The findings of this host's checks of ``env`` (default: this process's); ``ranks``: what they are filed
    under (a rank's own; the launcher's, before its ranks have numbers: none, ``where`` says the host and node);
    ``only``: just the checks of these variables."""
    from distdebug.doctor.checks import FAIL, PASS, check_variables, local_inputs

    interfaces, has_ib, _, _ = local_inputs()
    return [Finding(
        severity=Severity.ERROR if c.status == FAIL else Severity.WARNING, detector=NAME,
        ranks=list(ranks), step=None, subject=c.name, message=c.detail, fix=c.fix or None,
        evidence={"check": c.name, "status": c.status, **(where or {})},
    ) for c in check_variables(checked(env), interfaces, has_ib)
        if c.status != PASS and (only is None or c.name in only)]


def own_first_rank(layout: dict[str, dict[str, Any]], launcher_pid: int) -> int | None:
    """The global rank of the local rank 0 this launcher started (its start record's parent pid is the launcher's),
    in its last attempt: what the launcher's findings are filed under once the ranks have numbers (torch's c10d
    rendezvous numbers the nodes itself, and --node-rank may be absent). None: no such rank recorded its start."""
    mine = [(info.get("attempt") or 0, int(r)) for r, info in layout.items()
            if info.get("ppid") == launcher_pid and info.get("local_rank") == 0]
    return max(mine)[1] if mine else None


def changed_since(seen: str | None, env: dict[str, str] | None = None) -> set[str] | None:
    """The checked variables whose value differs from what the launcher saw (``seen``: its JSON); None when no
    launcher of ours made the checks (or its note is unreadable): check everything."""
    try:
        before = json.loads(seen) if seen else None
    except ValueError:
        before = None
    if not isinstance(before, dict):
        return None
    now = checked(env)
    return {k for k in set(before) | set(now) if before.get(k) != now.get(k)}


class EnvCheck(Detector):
    name = NAME
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    def setup(self, ctx: RankContext) -> None:
        if ctx.identity.local_rank != 0:
            return  # torch's launcher hands every rank of a node the same environment: one report per node
        only = changed_since(envvars.get(envvars.ENV_CHECKED))
        if only == set():
            return  # the node's launcher checked exactly this
        for f in node_findings([ctx.rank], only=only):
            ctx.report(f)

    def on_step(self, event: Any) -> Iterable[Finding]:
        return ()

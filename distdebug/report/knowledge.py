"""The report's advice: each finding's card (distdebug.cards) read in its incident's context.

A detector already knows more than a symptom (which rank, which tensor), so its own ``fix`` stays first where
its card says so; the card adds the *why* and what to look at next, as PyTorch behaves (after DDP's all-reduce
every rank holds the averaged gradient, so clip_grad_norm_ needs no sqrt(world) rescaling; with
TORCH_NCCL_ASYNC_ERROR_HANDLING=0 a failed NCCL collective hangs instead of ending the job).

The context is the causal model (cards.kinds, the same table the incidents group by): a finding that follows from
its incident's root by a chain of causal links is said to be "probably a consequence" of that root, unless its
card's variant already says how (a loss jump after a restore, initial weights that differ after one). Pure
functions: no torch, no rich.
"""

from __future__ import annotations

from typing import Any

from distdebug import cards
from distdebug.analysis.incidents import Incident, group
from distdebug.cards.base import (
    AFTER_END,
    CONFIG,
    DISK,
    ENVIRONMENT,
    HANG,
    HARNESS,
    LOSS_X10,
    LOSSES_DIFFER,
    NOTE,
    OOM,
    OOM_FORWARD,
    REPRODUCE,
    RESTORE,
    SLOW,
    Advice,
    Context,
)
from distdebug.findings import Finding

__all__ = ["AFTER_END", "CONFIG", "DISK", "ENVIRONMENT", "HANG", "HARNESS", "LOSSES_DIFFER", "LOSS_X10", "NOTE",
           "OOM", "OOM_FORWARD", "REPRODUCE", "RESTORE", "SLOW", "Advice", "advise", "advise_all",
           "findings_with_advice", "incidents_with_advice", "shown_fix"]


def advise(f: Finding, *, run_dir: str = "RUN", root: Finding | None = None) -> Advice:
    """The advice for one finding. ``root``: the root of the incident it follows from (another detector's
    finding), if any; the advice then says it is probably that root's consequence."""
    c = Context(run_dir=run_dir, root=root)
    card = cards.get(f.detector)
    if card is None:
        return cards.advise(f, c)
    v = card.variant(f, c)
    a = card.advise(f, c, v)
    if root is None or v.explains_root:
        return a
    rc = cards.get(root.detector)
    noun = rc.noun if rc is not None else f"the {root.detector} finding"
    when = f" from step {root.step}" if root.step is not None else ""
    code = f"{rc.code} " if rc is not None else ""
    return Advice(a.symptom, f"probably a consequence of {noun}{when} ({code}{root.detector} on {root.subject}); "
                  f"otherwise: {a.cause}", a.check,
                  f"fix {noun} first (its finding says how): this one should then go away",
                  consequence_of=f"{code}{root.detector}{when.replace(' from', ' at')}")


def shown_fix(finding_fix: str | None, a: Advice) -> str:
    """The fix the report prints beside a finding: the root's to fix first for a consequence, else the finding's
    own (a detector that named the knob knows more than its card), else its card's."""
    return a.fix if a.consequence_of else (finding_fix or a.fix)


def _roots(findings: list[Finding], incidents: list[Incident] | None = None) -> dict[int, Finding]:
    """Each finding that is a consequence of its incident's root -> that root (by id)."""
    out: dict[int, Finding] = {}
    for inc in incidents if incidents is not None else group(findings):
        for m in inc.consequences():
            out[id(m)] = inc.root
    return out


def advise_all(findings: list[Finding], *, run_dir: str = "RUN",
               incidents: list[Incident] | None = None) -> list[Advice]:
    """Advice for each finding, in order, in the context of the incidents they make (analysis.incidents;
    ``incidents``: those already grouped from these findings)."""
    roots = _roots(findings, incidents)
    return [advise(f, run_dir=run_dir, root=roots.get(id(f))) for f in findings]


def _with_code(f: Finding, a: Advice) -> dict[str, Any]:
    card = cards.get(f.detector)
    return {**f.to_dict(), "code": card.code if card is not None else None, "advice": a.to_dict()}


def findings_with_advice(findings: list[Finding], *, run_dir: str = "RUN",
                         incidents: list[Incident] | None = None) -> list[dict[str, Any]]:
    """Each finding as a dict with its card's ``code`` and its ``advice`` (what ``report --json`` and ``--html``
    show)."""
    advice = advise_all(findings, run_dir=run_dir, incidents=incidents)
    return [_with_code(f, a) for f, a in zip(findings, advice, strict=True)]


def incidents_with_advice(incidents: list[Incident], findings: list[Finding], *,
                          run_dir: str = "RUN") -> list[dict[str, Any]]:
    """Each incident (analysis.incidents) as a dict: its severity, title, the fix (the root's own, else its
    advice's), the root and its members as findings with their advice (computed over all the run's findings, so
    that each member's root is its incident's)."""
    roots = _roots(findings, incidents)
    out = []
    for inc in incidents:
        def one(f: Finding) -> dict[str, Any]:
            return _with_code(f, advise(f, run_dir=run_dir, root=roots.get(id(f))))

        root = one(inc.root)
        out.append({"severity": inc.severity.value, "title": inc.title,
                    "fix": inc.root.fix or root["advice"]["fix"], "root": root,
                    "members": [one(m) for m in inc.members]})
    return out

"""The ground floor: what every layer says and reads (detectors, the runtime, analysis, reports).

A finding is the product's unit of output: who (ranks), when (step), what (subject), the evidence,
and what to do. It lives here, below every package, so that nothing importing it pulls a layer in.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class Severity(str, enum.Enum):
    """Ordered from least to most severe; ``order`` gives the position (0: info)."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"

    @property
    def order(self) -> int:
        return list(Severity).index(self)

    @property
    def meaning(self) -> str:
        return SEVERITY_MEANING[self.value]


SEVERITY_MEANING = {
    "info": "a note for reading the run, no fault: what distdebug could not check, a measurement, a verdict that "
            "clears a suspicion; never fails a run (--fail-on does not take it)",
    "warning": "probably wrong, or a trap that costs speed or correctness in some runs: a straggler, a setting "
               "that is legal but dangerous, a value received from another rank; worth a look before the next "
               "long run",
    "error": "the training computes something other than what it should: a NaN's origin, replicas that drifted, "
             "BatchNorm statistics that differ, a checkpoint restored wrong; its results are not to be trusted "
             "until fixed",
    "critical": "the job cannot go on or has already failed: a hang, a rank killed, out of memory, the weights "
                "non-finite for good",
}
"""What each severity means: the one definition, printed by --fail-on's help and the findings reference page."""


@dataclass(kw_only=True)
class Finding:
    """One diagnosis: who (ranks), when (step), what (subject), and the evidence for it.

    ``step`` is the 1-based optimizer step the finding refers to (None: not tied to a step).
    ``subject`` names a tensor, module, collective or ``detector:<name>`` for harness findings.
    """

    severity: Severity
    """``info``, ``warning``, ``error`` or ``critical``."""
    detector: str
    """What found it: a detector's name or another source's (hang, oom, ...): its card's name."""
    ranks: list[int]
    """The rank(s) it is about (the culprits, not every rank that saw it)."""
    step: int | None
    """The 1-based optimizer step it refers to; None: not tied to a step."""
    subject: str
    """The tensor, module, collective or setting it is about."""
    message: str
    """What was found, in a sentence."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """The numbers behind it (values, per-rank figures, stacks), as the detector recorded them."""
    fix: str | None = None
    """What to do, where the detector knows better than its card (a framework knob it found)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["severity"] = Severity(self.severity).value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        return cls(
            severity=Severity(d.get("severity", "info")),
            detector=str(d.get("detector", "?")),
            ranks=[int(r) for r in d.get("ranks", [])],
            step=d.get("step"),
            subject=str(d.get("subject", "")),
            message=str(d.get("message", "")),
            evidence=dict(d.get("evidence") or {}),
            fix=d.get("fix"),
        )


def ranks_text(ranks: list[int]) -> str:
    """``rank 7`` / ``ranks 0-6, 8-15``: runs of consecutive ranks as ranges (what a thousand ranks' text
    needs); ``rank ?`` for none."""
    ranks = sorted(ranks)
    if not ranks:
        return "rank ?"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def at_or_above(findings: list[Finding], level: str) -> list[Finding]:
    """The findings a ``--fail-on level`` gate fails on: the training's findings of that severity or worse.
    distdebug's own trouble (detector ``harness``: a detector that failed, a disk it could not write) is said
    in the report but never fails the gate: the training did nothing wrong there."""
    floor = Severity(level).order
    return [f for f in findings if Severity(f.severity).order >= floor and f.detector != "harness"]


def gate_line(level: str, failing: list[Finding]) -> str:
    """The one line a failed gate prints: how many, and the first few (detector, subject, step, ranks)."""
    shown = "; ".join(f"{Severity(f.severity).value} {f.detector} {f.subject}"
                      + (f" at step {f.step}" if f.step is not None else "")
                      + (f" on rank(s) {','.join(map(str, f.ranks[:8]))}" if f.ranks else "") for f in failing[:3])
    more = f"; and {len(failing) - 3} more" if len(failing) > 3 else ""
    return f"--fail-on {level}: {len(failing)} finding(s) at or above {level}: {shown}{more}"

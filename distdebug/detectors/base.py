"""The detector interface: step events in, findings out.

A detector runs inside every rank. It is built once per rank, gets ``attach(ctx)`` after the
first step boundary (when models, optimizers and the process group are known), then
``on_step(event)`` at every step boundary and ``on_end()`` when the script finishes. Any
exception it raises switches that detector off on that rank and becomes a harness finding:
training itself never sees it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from distdebug.runtime.session import RankContext


class Severity(str, enum.Enum):
    """Ordered from least to most severe; ``rank`` gives the order."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return list(Severity).index(self)


@dataclass(kw_only=True)
class Finding:
    """One diagnosis: who (ranks), when (step), what (subject), and the evidence for it.

    ``step`` is the 1-based optimizer step the finding refers to (None: not tied to a step).
    ``subject`` names a tensor, module, collective or ``detector:<name>`` for harness findings.
    """

    severity: Severity
    detector: str
    ranks: list[int]
    step: int | None
    subject: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str | None = None

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


@dataclass(frozen=True, kw_only=True)
class StepEvent:
    """What one rank saw in one step. Times in seconds; loss is the mean of the step's backward losses."""

    rank: int
    step: int
    loss: float | None
    step_time_s: float
    backward_calls: int
    collectives: int
    backward_total: int = 0
    """Backward calls since the start: equal across ranks in lockstep training, even when a rank
    skips optimizer.step (which the step number alone cannot show)."""


class Detector:
    """Base class; subclasses set ``name`` and ``description`` and override what they need."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    default: ClassVar[bool] = True
    """Whether the detector runs when ``--detectors`` is not given."""

    def setup(self, ctx: RankContext) -> None:
        """Called once per rank before the script runs (for hooks needed from the first line on)."""

    def attach(self, ctx: RankContext) -> None:
        """Called once per rank after discovery (first step boundary)."""

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        return ()

    def on_end(self) -> Iterable[Finding]:
        return ()

    def before_destroy(self) -> None:
        """Called before the script destroys its process groups: release any group of your own."""

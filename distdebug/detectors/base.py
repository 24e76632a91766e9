"""The detector interface: step events in, findings out.

A detector runs inside every rank. It is built once per rank, gets ``attach(ctx)`` after the
first step boundary (when models, optimizers and the process group are known), then
``on_step(event)`` at every step boundary and ``on_end()`` when the script finishes. Any
exception it raises switches that detector off on that rank and becomes a harness finding:
training itself never sees it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

# Finding, Severity, StepEvent and RankContext live on the ground floor (distdebug.findings,
# distdebug.context); they are re-exported here because a plugin detector imports them from here.
from distdebug.context import RankContext, StepEvent
from distdebug.findings import Finding, Severity

__all__ = ["Detector", "Finding", "RankContext", "Severity", "StepEvent"]


class Detector:
    """Base class; subclasses set ``name`` and ``description`` and override what they need."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    default: ClassVar[bool] = True
    """Whether the detector runs when ``--detectors`` is not given."""
    Config: ClassVar[type | None] = None
    """A configurable detector's options: a kw_only dataclass, one docstring per field (defaults live
    there and nowhere else). The detector is then built as ``cls(config)``; ``distdebug attach
    --detector-option NAME.KEY=VALUE`` sets a field, typed by its annotation. None: built as ``cls()``."""
    config: Any = None

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

"""LossNonFinite: the first step whose loss is NaN or infinite, per rank.

The cheapest useful sentinel: the loss is already a host float at each step boundary, so the
check costs one ``math.isfinite``. Later steps with a non-finite loss are counted, not repeated,
so a run that stays NaN produces one finding with the count, not thousands.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from distdebug.cards.loss_nonfinite import CARD
from distdebug.context import StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity


class LossNonFinite(Detector):
    name = "loss_nonfinite"
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    def __init__(self) -> None:
        self.first_step: int | None = None
        self.count = 0
        self.rank = 0

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        if event.loss is None or math.isfinite(event.loss):
            return ()
        self.count += 1
        self.rank = event.rank
        if self.first_step is not None:
            return ()
        self.first_step = event.step
        return (
            Finding(
                severity=Severity.ERROR,
                detector=self.name,
                ranks=[event.rank],
                step=event.step,
                subject="loss",
                message=f"loss is {event.loss} at step {event.step}",
                evidence={"loss": str(event.loss)},
                fix="check for NaN/Inf gradients and the learning rate; torch.autograd.set_detect_anomaly "
                "on a short rerun names the operation",
            ),
        )

    def on_end(self) -> Iterable[Finding]:
        if self.count > 1:
            return (
                Finding(
                    severity=Severity.WARNING,
                    detector=self.name,
                    ranks=[self.rank],
                    step=self.first_step,
                    subject="loss",
                    message=f"loss stayed non-finite in {self.count} steps from step {self.first_step} on",
                    evidence={"nonfinite_steps": self.count},
                ),
            )
        return ()

"""LossScale: what an AMP loss scaler did (torch.amp.GradScaler, DeepSpeed fp16 dynamic loss scale).

A scaler multiplies the loss before backward so that small fp16 gradients do not underflow; when the
scaled gradients overflow it skips that optimizer step and lowers the scale, and it raises the scale
again after a run of good steps. A skipped step is the scaler working as designed, not a NaN: it is
an info record, ``scaler skipped step N: scale X -> Y``, and the NaN and spike checks leave that step
alone (the session marks it: ``StepEvent.skipped``). What is worth a warning is a scale that keeps
collapsing: below ``min_scale`` (1 by default: gradients are then scaled *down*), or
``skipped_in_a_row`` skipped steps in a row once the scaler has found a scale that works (the gradients
are non-finite whatever the scale: a real NaN or Inf that the scaler cannot cure, or a model in fp16
that needs bf16).

Calibration is not collapse. A run's first steps are skipped until the scale has come down from its
initial value to one the gradients fit: PyTorch's GradScaler says so ("the scale factor often causes
infs/NaNs to appear in gradients for the first few iterations as its value calibrates"), and it takes
log2(initial / fitting) steps: 14 from Megatron's and many DeepSpeed configs' 2^32 to 2^18. Until a step
has been applied, a run of skips is that search (each its info record); what bounds it is ``min_scale``:
a search that falls below it found no scale, which is then the warning.

The scale comes with the step's one host read (GradScaler's scale tensor) or from DeepSpeed's own
host value; which steps were skipped is known on the host (GradScaler.step did not call the
optimizer's step; DeepSpeed's ``overflow`` flag). Nothing here reads a device tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

from distdebug.cards.loss_scale import CARD
from distdebug.config import LossScaleConfig
from distdebug.context import StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity

MAX_INFO = 20
"""Skipped steps recorded one by one; later ones are counted in one record at the end."""


class LossScale(Detector):
    name = "loss_scale"
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    Config = LossScaleConfig

    def __init__(self, config: LossScaleConfig | None = None) -> None:
        self.config = config or LossScaleConfig()
        self.rank = 0
        self.pending: tuple[int, float | None] | None = None  # (skipped step, its scale): said at the next step
        self.skipped: list[int] = []
        self.run: list[int] = []  # the current run of skipped steps
        self.warned_run = False
        self.warned_low = False
        self.calibrated = False  # a step has been applied: the scaler has found a scale the gradients fit

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        self.rank = event.rank
        out = []
        if self.pending is not None:
            out.append(self._skip_record(*self.pending, after=event.loss_scale))
            self.pending = None
        if event.skipped:
            self.skipped.append(event.step)
            self.run.append(event.step)
            if len(self.skipped) <= MAX_INFO:
                self.pending = (event.step, event.loss_scale)
            if len(self.run) >= self.config.skipped_in_a_row and self.calibrated and not self.warned_run:
                self.warned_run = True
                out.append(Finding(
                    severity=Severity.WARNING, detector=self.name, ranks=[event.rank], step=self.run[0],
                    subject="loss scale",
                    message=f"the loss scaler skipped {len(self.run)} steps in a row ({self._steps(self.run)}): the "
                            "gradients are non-finite whatever the scale"
                            + (f" (now {event.loss_scale:g})" if event.loss_scale is not None else ""),
                    evidence={"skipped_steps": self.run[:50], "loss_scale": event.loss_scale},
                    fix="a real NaN/Inf that lowering the scale cannot cure (see nan_origin), or fp16 ranges too "
                        "narrow for this model: bf16 autocast needs no loss scaling",
                ))
        else:
            self.run = []
            self.calibrated = True
        scale = event.loss_scale
        if scale is not None and scale < self.config.min_scale and not self.warned_low:
            self.warned_low = True
            out.append(Finding(
                severity=Severity.WARNING, detector=self.name, ranks=[event.rank], step=event.step,
                subject="loss scale",
                message=f"the loss scale fell to {scale:g} at step {event.step} (below {self.config.min_scale:g}), "
                        f"after skipped steps {self._steps(self.skipped)}: "
                        + ("gradients are now scaled down and small ones vanish" if self.calibrated else
                           "no step has been applied yet: no scale makes the gradients finite (a NaN/Inf in "
                           "every step's backward, not an overflow)"),
                evidence={"loss_scale": scale, "skipped_steps": self.skipped[-50:]},
                fix="look for the step where the values first grow (loss_spike, nan_origin); or bf16 autocast",
            ))
        return out

    def _skip_record(self, step: int, before: float | None, after: float | None) -> Finding:
        scales = f": scale {before:g} -> {after:g}" if before is not None and after is not None else ""
        return Finding(
            severity=Severity.INFO, detector=self.name, ranks=[self.rank], step=step, subject="skipped step",
            message=f"scaler skipped step {step}{scales} (its scaled gradients overflowed; the scaler skips the "
                    "update and lowers the scale by design)",
            evidence={"scale_before": before, "scale_after": after},
        )

    @staticmethod
    def _steps(steps: list[int]) -> str:
        return ", ".join(map(str, steps[:8])) + (" ..." if len(steps) > 8 else "")

    def on_end(self) -> Iterable[Finding]:
        out = []
        if self.pending is not None:
            out.append(self._skip_record(*self.pending, after=None))
            self.pending = None
        if len(self.skipped) > MAX_INFO:
            out.append(Finding(
                severity=Severity.INFO, detector=self.name, ranks=[self.rank], step=self.skipped[0],
                subject="skipped step", message=f"the loss scaler skipped {len(self.skipped)} steps in all "
                                                 f"({MAX_INFO} recorded one by one)",
                evidence={"skipped": len(self.skipped)},
            ))
        return out

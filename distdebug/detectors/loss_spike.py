"""LossSpike: a loss or gradient-norm value far above its recent history, per rank.

Robust, so that normal training does not trip it, and blind to trends, so that the fast drop of
early training does not blunt it: the level is the median of the last LEVEL values, the scale the
noise of the last ``window`` values measured on their step-to-step differences (MAD of the
differences x 1.4826 / sqrt 2: a steady drop moves every difference alike and leaves it small),
floored at 5% of the level so that a flat plateau does not make every wiggle a spike. A value is a
spike when it exceeds level + threshold x scale; one-sided. The first MIN_HISTORY steps only fill
the window, and a spike is not added to it. Consecutive spiking steps are one episode, reported
at its first step; after LEVEL of them the values count as a new level.

The gradient norm is the L2 norm of this rank's gradients at the step boundary (after reduction
under DDP; the local shards under FSDP2/ZeRO): one fused norm and one host read per step.

``--spike-threshold`` (default 8) and ``--spike-window`` (default 50) set it. A finding per
spiking step and signal, at most MAX_FINDINGS per signal (then counted).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from distdebug import envvars
from distdebug.detectors.base import Detector, Finding, Severity, StepEvent
from distdebug.fingerprint.hashing import local_view

MIN_HISTORY = 10
LEVEL = 5
MAX_FINDINGS = 5
REL_FLOOR = 0.05


def spike(history: list[float], value: float, threshold: float) -> tuple[bool, float, float]:
    """(is value a spike against history, the level it is measured from, robust z)."""
    if len(history) < MIN_HISTORY or not math.isfinite(value):
        return False, float("nan"), 0.0
    level = statistics.median(history[-LEVEL:])
    diffs = [b - a for a, b in zip(history, history[1:], strict=False)]
    center = statistics.median(diffs)
    noise = 1.4826 * statistics.median(abs(d - center) for d in diffs) / math.sqrt(2)
    scale = max(noise, REL_FLOOR * abs(level), 1e-12)
    z = (value - level) / scale
    return z > threshold, level, z



class LossSpike(Detector):
    name = "loss_spike"
    description = "loss or gradient norm far above its recent median (robust z over a window), per rank"

    def __init__(self) -> None:
        self.threshold = float(envvars.get(envvars.SPIKE_THRESHOLD) or 8.0)
        self.window = int(envvars.get(envvars.SPIKE_WINDOW) or 50)
        self.history: dict[str, deque[float]] = {"loss": deque(maxlen=self.window),
                                                 "grad_norm": deque(maxlen=self.window)}
        self.found: dict[str, int] = {"loss": 0, "grad_norm": 0}
        self.run: dict[str, int] = {"loss": 0, "grad_norm": 0}  # consecutive spiking steps
        self.params: list[torch.nn.Parameter] = []
        self.rank = 0

    def attach(self, ctx: Any) -> None:
        from distdebug.runtime.discovery import unwrap

        self.params = [p for root in ctx.models for p in unwrap(root)[0].parameters()]

    def _grad_norm(self) -> float | None:
        grads = [local_view(p.grad) for p in self.params if p.grad is not None]
        grads = [g for g in grads if g.numel()]
        if not grads:
            return None
        return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0))))

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        self.rank = event.rank
        out = []
        for signal, value in (("loss", event.loss), ("grad_norm", self._grad_norm())):
            if value is None or not math.isfinite(value):
                continue  # NaN/Inf are nan_origin's and loss_nonfinite's
            hist = self.history[signal]
            is_spike, med, z = spike(list(hist), value, self.threshold)
            if is_spike:
                self.run[signal] += 1
                if self.run[signal] > LEVEL:
                    hist.append(value)  # elevated for LEVEL steps: a new level, no longer a spike
                    continue
                if self.run[signal] > 1:
                    continue  # the same episode: reported at its first step
                self.found[signal] += 1
                if self.found[signal] <= MAX_FINDINGS:
                    label = "loss" if signal == "loss" else "gradient norm"
                    out.append(Finding(
                        severity=Severity.WARNING, detector=self.name, ranks=[event.rank], step=event.step,
                        subject=signal,
                        message=f"{label} spike at step {event.step}: {value:.4g}, {value / med if med else 0:.1f}x "
                                f"the level {med:.4g} of the last steps (robust z {z:.1f} > "
                                f"{self.threshold:g})",
                        evidence={"value": value, "median": med, "robust_z": z, "window": len(hist),
                                  "threshold": self.threshold},
                        fix="a bad batch (look at the data of that step), a learning-rate schedule jump, or "
                            "instability before a NaN; gradient clipping and a lower learning rate damp it",
                    ))
                continue  # a spike does not become the new normal
            self.run[signal] = 0
            hist.append(value)
        return out

    def on_end(self) -> Iterable[Finding]:
        return [Finding(severity=Severity.INFO, detector=self.name, ranks=[self.rank], step=None, subject=signal,
                        message=f"{n} {signal} spikes in all, {MAX_FINDINGS} reported", evidence={"spikes": n})
                for signal, n in self.found.items() if n > MAX_FINDINGS]

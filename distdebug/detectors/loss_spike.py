"""LossSpike: a loss or gradient-norm value far above its recent history, per rank.

Robust, so that normal training does not trip it, and blind to trends, so that the fast drop of
early training does not blunt it: the level is the median of the last LEVEL values, the scale the
noise of the last ``window`` values measured on their step-to-step differences (MAD of the
differences x 1.4826 / sqrt 2: a steady drop moves every difference alike and leaves it small),
floored at 5% of the level so that a flat plateau does not make every wiggle a spike. A value is a
spike when it exceeds level + threshold x scale; one-sided. The loss is judged both ways, and a fall
is a collapse only when it also goes below COLLAPSE of the lowest recent value (an order of magnitude,
or to zero; fast learning is 2-3x). The first MIN_HISTORY steps only fill the window, and a spike is
not added to it. Consecutive spiking steps are one episode, reported at its first step; after LEVEL of
them the values count as a new level.

The gradient norm is the L2 norm of this rank's own gradients when its backward ends, before the
script's clipping: before their reduction under DDP's default (``gradient_as_bucket_view=False``, read
at the end of the backward, before DDP writes the reduced ones back) and under a hand-written
all_reduce (called after backward returns), so a spike is named on the rank whose batch made it;
after it where the reduction happens inside the backward (DDP's bucket views, FSDP2, ZeRO: each
rank's shard). One fused norm a step, read with the step's other values; under DDP's default it is the
norm of the local gradients nan_origin reads too, computed once for both (runtime.localgrads).

Across ranks (the loss only): ranks see different batches, so their losses differ by some amount every
step; what is not normal is one rank's loss far above the others'. At the checked steps (2, 4, 8,
then every 16: ``runtime.exchange``) the ranks exchange their losses since the last check in the
background; rank 0 measures, step by step, each rank's distance above the median of all ranks
against the typical cross-rank spread of the last ``window`` steps (MAD, floored at 5% of the
median) with the same threshold. A rank that stays above is one episode, reported at its first
step: a rank whose replica drifted, whose data is corrupt, or whose BatchNorm statistics differ.

``--spike-threshold`` (default 8) and ``--spike-window`` (default 50) set both. A finding per
spiking step and signal, at most MAX_FINDINGS per signal (then counted).
"""

from __future__ import annotations

import math
import statistics
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from distdebug.cards.loss_spike import CARD
from distdebug.config import LossSpikeConfig
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.fingerprint.hashing import local_view
from distdebug.runtime.discovery import accumulating
from distdebug.runtime.exchange import ExchangeUser, checked_step
from distdebug.runtime.localgrads import local_grad_norms

MIN_HISTORY = 10
LEVEL = 5
MAX_FINDINGS = 5
REL_FLOOR = 0.05
GRAD_NORM_FLOOR = 0.25
"""The gradient norm's noise scale is at least a quarter of its level: a spike is then at least 1 +
threshold/4 = 3x its level. Healthy early training moves it by 2x from one step to the next (a ResNet's
step 11, a GPT's warm-up: bench/loss_traces.py); a corrupted batch moves it by far more."""
RULES: dict[str, dict[str, Any]] = {
    "loss": {"rel_floor": REL_FLOOR, "min_history": MIN_HISTORY},
    "grad_norm": {"rel_floor": GRAD_NORM_FLOOR, "min_history": MIN_HISTORY},
}
"""Per signal: spike()'s relative floor and the history it needs."""
COLLAPSE = 0.2
"""A fall of the loss is a collapse only below this fraction of the lowest of the last LEVEL values, whatever
its z (issue 45). A collapse (a broken batch, targets leaking the answer, a masked loss, a dead model) takes
the loss down by an order of magnitude or to zero; fast learning takes one rank's loss 2-3x down in a step,
and the median level, lagging a fall by two steps, reads that as far below it while the steady fall's
step-to-step differences leave the noise small (a ResNet with AdamW on 32-image batches: 1/1.8 of the level at
z -9). The lowest recent value does not lag: on the recorded clean curves no value went below 1/3.2 of it
(bench/loss_traces.py's resnet_fast; the TP and pipeline recipes' noisy losses 1/2.2), a fifth leaves room
beyond that and finds a x0.1 collapse of any value up to twice the recent low."""
EARLY_HISTORY = 5
EARLY_FLOOR = 0.1
"""The early rule (steps EARLY_HISTORY + 1 .. MIN_HISTORY, the loss only): the smallest noise scale, in log
units (10 %). A spike or collapse there is at least threshold x 0.1 = 0.8 log units from the trend's
prediction: below 0.45x or above 2.2x of it."""


def spike(history: list[float], value: float, threshold: float, both: bool = False, rel_floor: float = REL_FLOOR,
          min_history: int = MIN_HISTORY) -> tuple[bool, float, float]:
    """(is value a spike against history, the level it is measured from, robust z). ``both``: a value
    as far below the level counts too (a loss that collapses) when it is also below COLLAPSE of the lowest of
    the last LEVEL values (of a history that stayed positive: otherwise the z alone). ``rel_floor``: the
    smallest noise scale, a fraction of the level; ``min_history``: values needed before any is judged."""
    if len(history) < min_history or not math.isfinite(value):
        return False, float("nan"), 0.0
    level = statistics.median(history[-LEVEL:])
    floor = max(rel_floor * abs(level), 1e-12)
    if abs(value - level) <= threshold * floor:
        # Within the floor's reach: no noise estimate can make it a spike (the scale is at least the floor),
        # so the noise is not estimated (every step, every signal: issue 18). z is then a bound, |z| <= threshold.
        return False, level, (value - level) / floor
    diffs = [b - a for a, b in zip(history, history[1:], strict=False)]
    center = statistics.median(diffs)
    noise = 1.4826 * statistics.median(abs(d - center) for d in diffs) / math.sqrt(2)
    scale = max(noise, floor)
    z = (value - level) / scale
    if z < 0 and both and not _collapsed(history, value):
        return False, level, z
    return (abs(z) if both else z) > threshold, level, z


def _collapsed(history: list[float], value: float) -> bool:
    """Whether a fall to ``value`` is deep enough to be a collapse, against the lowest of the last LEVEL values:
    for a positive loss below COLLAPSE of it (or to zero and below); for a negative one (an ELBO, a sum of
    logits) 1/COLLAPSE times as far from zero, not the 2-3x a fast learner goes. A history that sits at zero
    has no scale: the noise alone decides there."""
    low = min(history[-LEVEL:])
    return low == 0 or value <= (COLLAPSE * low if low > 0 else low / COLLAPSE)


def early_spike(history: list[float], value: float, threshold: float) -> tuple[bool, float, float]:
    """The loss before MIN_HISTORY values (steps EARLY_HISTORY + 1 to MIN_HISTORY): (is value a spike or a
    collapse, the level it is measured from, robust z). Too few values for a median level and a noise
    estimate; early training falls fast and unevenly, and some scripts' losses move 4x from one step to the
    next (the tensor-parallel recipe's): so in log units (a loss falls by ratios, and a level can never
    turn negative), and judged by two levels that fail differently, a value counting only when it is
    beyond the threshold from both (the smaller z is reported):

    - the recent trend: the last three values carried forward by the median step; it follows a fall that
      has just begun after a plateau, and over-extrapolates noise that happens to lean one way;
    - a robust line through all the values (Theil-Sen: the median of the pairwise slopes); it is not led
      by a few noisy steps, and lags a change of pace.

    Each against the widest of its values' spread around it (MAD), its slope (a steep fall earns as much
    room), EARLY_FLOOR and, for tails a few values cannot show, twice its largest departure so far. A value
    at or below zero after positive values is a collapse (a sign flipped), and a fall counts only below COLLAPSE
    of the lowest of the last LEVEL values, as in the main rule; a history that is not all positive is left to
    the main rule."""
    if not EARLY_HISTORY <= len(history) < MIN_HISTORY or not math.isfinite(value) or min(history) <= 0:
        return False, float("nan"), 0.0
    logs = [math.log(v) for v in history]
    n = len(logs)
    steps = [b - a for a, b in zip(logs, logs[1:], strict=False)]
    trend = statistics.median(steps)
    # The last three values carried forward; their median, so that one odd value among them (a pipeline
    # recipe's 0.35 between 1.1 and 1.65) is not the level.
    recent = statistics.median(logs[i] + trend * (n - i) for i in range(n - 3, n))
    slope = statistics.median((logs[j] - logs[i]) / (j - i) for i in range(n) for j in range(i + 1, n))
    intercept = statistics.median(y - slope * i for i, y in enumerate(logs))
    line = intercept + slope * n
    judged = []
    for predicted, rate, deviations in ((recent, trend, [d - trend for d in steps]),
                                        (line, slope, [y - intercept - slope * i for i, y in enumerate(logs)])):
        spread = 1.4826 * statistics.median(abs(d) for d in deviations)
        widest = max(abs(d) for d in deviations)
        scale = max(spread, abs(rate), EARLY_FLOOR, 2 * widest / threshold)
        level = math.exp(predicted)
        z = (value - level) / (EARLY_FLOOR * level) if value <= 0 else (math.log(value) - predicted) / scale
        judged.append((abs(z) > threshold, level, z))
    (hit_a, level_a, z_a), (hit_b, level_b, z_b) = judged
    hit = hit_a and hit_b and (z_a > 0) == (z_b > 0) and (z_a > 0 or _collapsed(history, value))
    return (hit, level_a, z_a) if abs(z_a) <= abs(z_b) else (hit, level_b, z_b)


def _early(signal: str, hist: deque[float]) -> bool:
    """Whether a value of ``signal`` is judged by the early rule: the loss, before MIN_HISTORY values."""
    return signal == "loss" and len(hist) < MIN_HISTORY


def _relative(value: float, level: float) -> str:
    """How far a value is from its level, for a message: '21217.1x', '1/39.0 of', or the other side of 0."""
    ratio = value / level if level else 0.0
    if ratio <= 0:
        return "on the other side of zero from"
    return f"{ratio:.1f}x" if ratio >= 1 else f"1/{1 / ratio:.1f} of"


class CrossRank:
    """Each rank's loss against the other ranks', step by step (pure; rank 0 keeps one).

    A rank's distance is its loss minus the median of the *other* ranks' losses (leave-one-out: with
    two or three ranks a plain median would be the rank itself half the time). The scale is the
    MAD of the distances of normal (rank, step)s over the window, floored at 5% of the median.
    ``feed(step, {rank: loss})`` returns the ranks that start departing at that step, as
    (rank, loss, median of the others, robust z); a rank stays in its episode (reported once) until
    its z falls under half the threshold.

    A step where most ranks' losses spike against their own history (they jumped together: a bad
    learning rate, a corrupted update reduced into every replica) says nothing about one rank
    against the others and is left out, for LEVEL steps in a row (then the values are a new level).
    """

    def __init__(self, threshold: float, window: int) -> None:
        self.threshold = threshold
        self.window = window
        self.spread: deque[float] = deque(maxlen=window * 4)  # distances of normal (rank, step)s
        self.steps = 0
        self.departing: set[int] = set()
        self.own: dict[int, deque[float]] = {}  # each rank's own recent losses
        self.global_run = 0

    def feed(self, step: int, losses: dict[int, float | None]) -> list[tuple[int, float, float, float]]:
        values = {r: v for r, v in losses.items() if v is not None and math.isfinite(v)}
        if len(values) < 2 or len(values) < len(losses):
            return []  # a missing or non-finite loss is not a distance (NaN is nan_origin's)
        jumped = [r for r, v in values.items()
                  if spike(list(self.own.setdefault(r, deque(maxlen=self.window))), v, self.threshold)[0]]
        if 2 * len(jumped) > len(values) and self.global_run < LEVEL:
            self.global_run += 1
            return []  # most ranks moved together
        self.global_run = 0
        for r, v in values.items():
            if r not in jumped:
                self.own[r].append(v)
        others = {r: statistics.median(v for q, v in values.items() if q != r) for r in values}
        dist = {r: values[r] - others[r] for r in values}
        out = []
        now: set[int] = set()
        if self.steps >= MIN_HISTORY:
            center = statistics.median(self.spread)
            mad = statistics.median(abs(d - center) for d in self.spread)
            for r in sorted(values):
                scale = max(1.4826 * mad, REL_FLOOR * abs(others[r]), 1e-12)
                z = (dist[r] - center) / scale
                if z > (self.threshold / 2 if r in self.departing else self.threshold):
                    now.add(r)
                    if r not in self.departing:
                        out.append((r, values[r], others[r], z))
        self.spread.extend(d for r, d in dist.items() if r not in now)
        self.departing = now
        self.steps += 1
        return out


class LossSpike(ExchangeUser, Detector):
    name = "loss_spike"
    needs_model = True
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    Config = LossSpikeConfig

    def __init__(self, config: LossSpikeConfig | None = None) -> None:
        self.config = config or LossSpikeConfig()
        self.threshold = self.config.threshold
        self.window = self.config.window
        self.history: dict[str, deque[float]] = {"loss": deque(maxlen=self.window),
                                                 "grad_norm": deque(maxlen=self.window)}
        self.found: dict[str, int] = {"loss": 0, "grad_norm": 0}
        self.run: dict[str, int] = {"loss": 0, "grad_norm": 0}  # consecutive spiking steps
        self.params: list[torch.nn.Parameter] = []
        self._norm: Any = None  # the last backward's gradient norm (a device scalar), read at the boundary
        self._ddps: list[weakref.ref[Any]] = []  # DDP wrappers: in their no_sync() the gradients are not read
        self._reader: Any = None  # this detector's entry in ctx.end_of_backward (DDP's default: local gradients)
        self._shared: Any = None  # ... or in the shared norms' listeners (runtime.localgrads)
        self._as_backward_left = False  # this step's norm was read when its backward ended (not at the boundary)
        self.sharded = False
        self.rank = 0
        self.ctx: RankContext | None = None
        self.losses: list[tuple[int, float]] = []  # (step, loss) since the last exchange
        self.cross = CrossRank(self.threshold, self.window)
        self.cross_found = 0
        self._phase_start = False  # handed a loss history at a new training phase: its first loss may move it

    def handover(self, successor: Detector) -> None:
        """The loss goes on across a training phase (a fit that resumes: its spikes are judged against the
        history before it); the gradient norm is the model's, and starts afresh with the new model."""
        if not isinstance(successor, LossSpike):
            return
        successor.history["loss"] = self.history["loss"]
        successor.found, successor.cross, successor.cross_found = self.found, self.cross, self.cross_found
        successor.losses, self.losses = self.losses, []
        successor._phase_start = True

    def attach(self, ctx: RankContext) -> None:
        from distdebug.runtime.discovery import find_ddp, unwrap

        self.ctx = ctx
        self.params = [p for root in ctx.models for p in unwrap(root)[0].parameters()]
        ddps = [d for d in (find_ddp(root) for root in ctx.models) if d is not None]
        self._ddps = [weakref.ref(d) for d in ddps]
        self.sharded = any(type(p) is not torch.nn.Parameter for p in self.params)
        if ddps and not any(getattr(d, "gradient_as_bucket_view", True) for d in ddps):
            # DDP's default reduces copies and writes the reduced gradients back when it finalises: at the
            # end of the backward .grad is still this rank's own (as nan_origin reads it). Its norm is this
            # rank's, as under a hand-written all_reduce, so a spike names the rank whose batch made it.
            if len(ctx.models) == 1 and len(ddps) == 1:
                # one model: the norms nan_origin reads too, computed once (runtime.localgrads)
                shared = local_grad_norms(ctx, ddps[0])
                self._reader = self.guarded(self._shared_norm)
                shared.listeners.append(self._reader)
                self._shared = shared
            else:
                self._reader = self.guarded(self._local_norm)
                ctx.end_of_backward.append(self._reader)
        self.open_exchange(ctx)

    def _cross_rank(self, event: StepEvent) -> None:
        """Queue this rank's losses at the checked steps; rank 0 judges them on the exchange's thread."""
        if self.exchange is None:
            return
        self.last_step = event.step
        if event.loss is not None:
            self.losses.append((event.step, event.loss))
        if checked_step(event.step):
            self.flush_pending()

    def flush_pending(self) -> None:
        mine, self.losses = self.losses, []

        def judge(gathered: list[Any]) -> None:
            ctx = self.ctx
            assert ctx is not None  # set in setup()/attach(), which the session calls first
            if ctx.rank != 0:
                return
            by_step: dict[int, dict[int, float | None]] = {}
            for rank, records in enumerate(gathered):
                for step, loss in records or []:
                    by_step.setdefault(step, {})[rank] = loss
            for step in sorted(by_step):
                if len(by_step[step]) < len(gathered):
                    continue
                for rank, value, med, z in self.cross.feed(step, by_step[step]):
                    self.cross_found += 1
                    if self.cross_found > MAX_FINDINGS:
                        continue
                    ctx.report(Finding(
                        severity=Severity.WARNING, detector=self.name, ranks=[rank], step=step,
                        subject="loss across ranks",
                        message=f"rank {rank}'s loss departs from the other ranks' at step {step}: {value:.4g} "
                                f"against the others' median {med:.4g} (robust z {z:.1f} > {self.threshold:g} over the "
                                "usual spread between ranks)",
                        evidence={"value": value, "median_of_other_ranks": med, "robust_z": z,
                                  "losses": {str(r): v for r, v in by_step[step].items()}},
                        fix="this rank's batch at that step (corrupt data?), its replica (distdebug diff RUN "
                            "--step N shows which tensors differ), or its BatchNorm statistics (bn_divergence)",
                    ))

        if self.exchange is not None:
            self.exchange.post(mine, judge)

    def after_backward(self) -> None:
        # The norm as backward left it, before the script's own clip_grad_norm_ (which would hide the
        # spike); with accumulation, the last backward's (every micro-batch's gradients summed): under
        # DDP's no_sync() the backwards before it are not read at all.
        if self._reader is None:
            self._local_norm()

    def _shared_norm(self, key: tuple[str, ...], norms: Any) -> None:
        with torch.no_grad():
            self._norm = torch.linalg.vector_norm(norms)  # a device scalar, read at the boundary

    def _local_norm(self) -> None:
        if self.params and not accumulating([d for d in (r() for r in self._ddps) if d is not None]):
            self._norm = self._grad_norm()

    def probe(self, step: int) -> dict[str, Any] | None:
        norm, self._norm = self._norm, None
        # Read as the backward left them (scaled, under a loss scaler), or here at the boundary, where a
        # scaler's step has already unscaled them: on_step divides the scale out of the first kind only.
        self._as_backward_left = norm is not None
        if norm is None:
            norm = self._grad_norm()  # a step whose backward was not seen (DeepSpeed's own, a custom loop)
        return None if norm is None else {"grad_norm": norm}

    def _grad_norm(self) -> Any:
        if self.sharded:
            grads = [v for p in self.params if (g := p.grad) is not None and (v := local_view(g)).numel()]
        else:  # plain tensors as they are: no per-step view per parameter; each .grad fetched once
            grads = [g for p in self.params if (g := p.grad) is not None and g.numel()]
        if not grads:
            return None
        with torch.no_grad():
            # A device scalar: read with the step's other values (runtime.readout), not here.
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)))

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        self.rank = event.rank
        self._cross_rank(event)
        out: list[Finding] = []
        if event.skipped:
            return out  # a loss scaler skipped the update (overflow): its gradients say nothing
        norm = self.values(event).get("grad_norm")
        if norm is not None and event.loss_scale and self._as_backward_left:
            # Read as the backward left them: a loss scaler's gradients are scaled, and the scale doubles every
            # growth_interval clean steps (a false spike each time); the scale of this step's backward divides
            # it out, as the loss's is (the script's own unscale_ comes after the reading).
            norm = norm / event.loss_scale
        for signal, value in (("loss", event.loss), ("grad_norm", norm)):
            if value is None or not math.isfinite(value):
                continue  # NaN/Inf are nan_origin's and loss_nonfinite's
            hist = self.history[signal]
            if signal == "loss" and self._phase_start:
                self._phase_start = False
                if self._judge(signal, hist, value)[0]:
                    hist.clear()  # a new phase that starts elsewhere (a fresh model, the next fold): a new level
            # The loss both ways (a collapse, a loss gone negative, is as wrong as a jump); the gradient
            # norm upward only (it falls as training converges).
            early = _early(signal, hist)
            is_spike, med, z = self._judge(signal, hist, value)
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
                    kind = "spike" if z > 0 else "collapse"
                    out.append(Finding(
                        severity=Severity.WARNING, detector=self.name, ranks=[event.rank], step=event.step,
                        subject=signal,
                        message=f"{label} {kind} at step {event.step}: {value:.4g}, {_relative(value, med)} "
                                + (f"the {med:.4g} that the first {len(hist)} steps' trend led to" if early else
                                   f"the level {med:.4g} of the last steps")
                                + f" (robust z {z:.1f}, beyond {self.threshold:g})",
                        evidence={"value": value, "median": med, "robust_z": z, "window": len(hist),
                                  "threshold": self.threshold, "rule": "early" if early else "level"},
                        fix="a bad batch (look at the data of that step), a learning-rate schedule jump, or "
                            "instability before a NaN; gradient clipping and a lower learning rate damp it",
                    ))
                continue  # a spike does not become the new normal
            self.run[signal] = 0
            hist.append(value)
        return out

    def _judge(self, signal: str, hist: deque[float], value: float) -> tuple[bool, float, float]:
        """(spike, level, z) of one value: the loss both ways (from step 6, by the early rule until MIN_HISTORY
        values), the gradient norm upward only."""
        if _early(signal, hist):
            return early_spike(list(hist), value, self.threshold)
        return spike(list(hist), value, self.threshold, both=signal == "loss", **RULES[signal])

    def on_end(self) -> Iterable[Finding]:
        self.close_exchange(clean=False)
        if self._reader is not None and self.ctx is not None and self._reader in self.ctx.end_of_backward:
            self.ctx.end_of_backward.remove(self._reader)
        if self._shared is not None and self._reader in self._shared.listeners:
            self._shared.listeners.remove(self._reader)
        found = dict(self.found)
        if self.cross_found:
            found["loss across ranks"] = self.cross_found
        return [Finding(severity=Severity.INFO, detector=self.name, ranks=[self.rank], step=None, subject=signal,
                        message=f"{n} {signal} spikes in all, {MAX_FINDINGS} reported", evidence={"spikes": n})
                for signal, n in found.items() if n > MAX_FINDINGS]

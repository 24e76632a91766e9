"""BatchNormDivergence: BatchNorm statistics that differ across data-parallel ranks.

Two different problems, both invisible in a single-rank run:

- Running statistics (``running_mean``, ``running_var``, ``num_batches_tracked``) that drift apart:
  DDP with ``broadcast_buffers=False``, or a hand-written loop that never syncs buffers. Each rank
  then evaluates and checkpoints a different model. They are read at the start of the BatchNorm's
  forward, i.e. after DDP's buffer broadcast when it does one, so a synced run compares equal.
- Per-rank batch statistics that disagree: plain BatchNorm normalises each rank's batch with that
  rank's own mean and variance. With small per-rank batches or data that is not shuffled evenly,
  ranks normalise differently and the model's behaviour depends on the sharding; SyncBatchNorm
  computes the statistics over the global batch. The disagreement is measured per channel as the
  spread of the ranks' batch means in units of the pooled standard deviation.

Checked at steps 2, 4, 8 and then every CHECK_EVERY steps (the same steps on every rank); one
small all_gather_object per check, in the background (``runtime.exchange``): training never
waits for it. Each module is reported once, at the first step where it diverges.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from distdebug.cards.bn_divergence import CARD
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.runtime.discovery import unwrap
from distdebug.runtime.exchange import ExchangeUser
from distdebug.runtime.exchange import checked_step as checked
from distdebug.runtime.layout import partition

MATERIAL_SPREAD = 0.1
"""Plain BatchNorm is flagged only when the ranks' batch means disagree by more than sampling explains
(below) *and* by at least this many pooled standard deviations, typically over the channels: a
difference the normalisation would visibly carry into training."""

FALSE_ALARM_P = 1e-6
"""How unlikely the ranks' disagreement must be under sampling alone to be flagged (a run checks every
module at many steps: each check must be that safe)."""


def batch_mean_spread(per_rank: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """How far the ranks' batch means are apart, per channel in pooled standard deviations, and whether
    sampling explains it.

    Under sampling alone (every rank's batch drawn from the same data) each rank's channel mean varies by
    sigma / sqrt(n) for n independent samples, so T = n * sum over channels and ranks of
    ((mean_rc - mean_c) / sigma_c)^2 is at most a chi-square of channels * (ranks - 1) degrees of freedom.
    n is the batch size (``n``, dimension 0; the smallest rank's): pixels of one image are not
    independent, so counting them would make healthy convolutional runs look divergent. Returns
    ``worst`` (the largest channel's spread: the population standard deviation of the ranks' means in
    pooled std units) and its ``channel``, ``typical`` (the root mean square of the spreads over channels,
    scaled by sqrt(ranks / (ranks - 1)) so that it reads about 1/sqrt(n) under sampling alone, whatever
    the number of ranks), ``t`` and ``dof`` (None when n is not known).

    The largest channel alone is not a test: over 64 channels of 16 samples, sampling alone puts it near
    0.45 standard deviations, and healthy runs were flagged that way (issue 22)."""
    ranks = sorted(per_rank)
    channels = len(per_rank[ranks[0]]["mean"])
    worst, where, squares = 0.0, 0, 0.0
    for c in range(channels):
        means = [per_rank[r]["mean"][c] for r in ranks]
        var = sum(per_rank[r]["var"][c] for r in ranks) / len(ranks)
        avg = sum(means) / len(means)
        spread = math.sqrt(sum((m - avg) ** 2 for m in means) / len(means)) / math.sqrt(var + 1e-5)
        squares += spread * spread
        if spread > worst:
            worst, where = spread, c
    k = len(ranks)
    typical = math.sqrt(squares / channels * k / (k - 1)) if channels and k > 1 else 0.0
    ns = [v for v in (per_rank[r].get("n") for r in ranks) if isinstance(v, int) and v > 0]
    n = min(ns) if len(ns) == len(ranks) else None
    return {"worst": worst, "channel": where, "typical": typical, "n": n, "ranks": k,
            "t": None if n is None else n * k * squares, "dof": channels * (k - 1)}


def _chi2_quantile(dof: int, p: float) -> float:
    """The chi-square quantile exceeded with probability p (Wilson-Hilferty; p small)."""
    z = math.sqrt(2) * _inverse_erfc(2 * p)
    a = 2 / (9 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


def _inverse_erfc(y: float) -> float:
    """x with erfc(x) = y (bisection: called once per check)."""
    lo, hi = 0.0, 10.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if math.erfc(mid) > y:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


MIN_BATCH = 16
"""Below this many samples per rank the test says nothing: each rank's own variance, which the spread is
measured in, is then too uncertain for a false-alarm rate of FALSE_ALARM_P."""


def disagree(spread: dict[str, Any]) -> bool:
    """Whether the ranks' batch statistics disagree beyond sampling, and materially (see above). The
    variance is estimated from the ranks' own batches (ranks * (n - 1) degrees of freedom), which makes the
    tail heavier than the chi-square's: the quantile is scaled by that estimate's variance inflation."""
    n, t = spread.get("n"), spread["t"]
    if t is None or n is None or n < MIN_BATCH:  # no test, no finding
        return False
    within = spread["ranks"] * (n - 1)
    limit = _chi2_quantile(spread["dof"], FALSE_ALARM_P) * within / (within - 2) * n / (n - 1)
    return spread["typical"] >= MATERIAL_SPREAD and t > limit


class BatchNormDivergence(ExchangeUser, Detector):
    name = "bn_divergence"
    needs_model = True
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    def __init__(self) -> None:
        self.ctx: RankContext | None = None
        self.exchange: Any = None
        self.modules: list[tuple[str, torch.nn.Module, bool]] = []  # (name, module, is SyncBatchNorm)
        self.armed = False
        self.seen: dict[str, dict[str, Any]] = {}  # module -> this step's statistics
        self.reported: set[tuple[str, str]] = set()
        self._was_armed = False  # the step being read was a checked one
        self._keys: dict[str, list[str]] = {}  # module -> the statistics its hook took this step
        self._n: dict[str, int] = {}  # module -> its batch's size this step (samples per channel per rank)

    def attach(self, ctx: RankContext) -> None:

        self.ctx = ctx
        many = len(ctx.models) > 1
        for i, root in enumerate(ctx.models):
            inner = unwrap(root)[0]
            prefix = f"{type(inner).__name__}[{i}]." if many else ""
            for name, mod in inner.named_modules():
                if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
                    label = prefix + (name or type(mod).__name__)
                    self.modules.append((label, mod, isinstance(mod, torch.nn.SyncBatchNorm)))
                    self.hook(mod, "forward_pre", self._pre_hook(label))
        if self.modules:
            self.open_exchange(ctx)
        self.armed = self.exchange is not None and checked(2)  # attach comes at the end of step 1

    def _pre_hook(self, label: str) -> Any:
        def hook(module: Any, args: Any) -> None:
            if not self.armed or label in self.seen or not args or not isinstance(args[0], torch.Tensor):
                return
            x = args[0].detach()
            # Device tensors only (a few values per channel, copies: the forward updates the running
            # statistics in place); read at the boundary with the step's other values.
            stats: dict[str, Any] = {}
            if module.training and x.dim() >= 2 and x.numel() > x.shape[1]:
                dims = [d for d in range(x.dim()) if d != 1]
                stats["var"], stats["mean"] = torch.var_mean(x.float(), dim=dims, unbiased=False)
                self._n[label] = int(x.shape[0])  # independent samples: the batch (host metadata, no read)
            if module.running_mean is not None:
                stats["running_mean"] = module.running_mean.detach().to(torch.float32, copy=True)
                stats["running_var"] = module.running_var.detach().to(torch.float32, copy=True)
                nbt = module.num_batches_tracked
                if nbt is not None:
                    stats["num_batches_tracked"] = nbt.detach().clone()
            self.seen[label] = stats
        return hook

    def probe(self, step: int) -> dict[str, Any] | None:
        seen, self.seen = self.seen, {}
        self._was_armed, self.armed = self.armed, self.exchange is not None and checked(step + 1)
        if not self._was_armed:
            return None
        self._keys = {label: list(stats) for label, stats in seen.items()}
        return {f"{label}\0{key}": t for label, stats in seen.items() for key, t in stats.items()}

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        was_armed, self._was_armed = self._was_armed, False
        if not was_armed or self.exchange is None:
            return ()
        values = self.values(event)
        seen: dict[str, dict[str, Any]] = {}
        for label, keys in self._keys.items():
            stats = {key: values.get(f"{label}\0{key}") for key in keys}
            if any(v is None for v in stats.values()):
                continue  # the step's read failed
            stats.setdefault("num_batches_tracked", None)
            if label in self._n:
                stats["n"] = self._n[label]
            seen[label] = stats
        self._n = {}
        step = event.step

        layout = self.ctx.layout if self.ctx is not None else None
        group = layout.data_group() if layout is not None else None

        def verdict(gathered: list[Any]) -> None:
            ctx = self.ctx
            assert ctx is not None  # set in setup()/attach(), which the session calls first
            if ctx.rank != 0:  # every rank has the same view; one writes the verdict
                return
            per_rank = {r: (g or {}).get("stats", {}) for r, g in enumerate(gathered)}
            # compared within data-parallel groups only (runtime.layout): TP and pipeline peers are not replicas
            for ranks in partition({r: (g or {}).get("group") for r, g in enumerate(gathered)}):
                for f in self._compare(step, {r: per_rank[r] for r in ranks}):
                    ctx.report(f)

        self.exchange.post({"stats": seen, "group": group}, verdict)
        return ()

    def _compare(self, step: int, per_rank: dict[int, dict[str, dict[str, Any]]]) -> list[Finding]:
        out: list[Finding] = []
        for label, _, is_sync in self.modules:
            stats = {r: s[label] for r, s in per_rank.items() if label in s}
            if len(stats) < 2:
                continue
            diffs = {}
            for key in ("running_mean", "running_var"):
                values = [stats[r].get(key) for r in sorted(stats)]
                if all(v is not None for v in values):
                    t = torch.tensor(values)
                    diffs[key] = float((t.max(0).values - t.min(0).values).max())
            counts = {r: stats[r].get("num_batches_tracked") for r in sorted(stats)}
            if any(diffs.values()) or len(set(counts.values())) > 1:
                if (label, "running") not in self.reported:
                    self.reported.add((label, "running"))
                    first = min(stats)
                    odd = [r for r in sorted(stats) if stats[r].get("running_mean") != stats[first].get("running_mean")]
                    out.append(Finding(
                        severity=Severity.ERROR, detector=self.name, ranks=sorted(stats), step=step, subject=label,
                        message=f"BatchNorm running statistics of {label} differ across ranks at step {step}: "
                                f"running_mean max |difference| {diffs.get('running_mean', 0):.3g}, running_var "
                                f"{diffs.get('running_var', 0):.3g}, num_batches_tracked {counts}; each rank will "
                                "evaluate and checkpoint a different model",
                        evidence={"max_abs_diff": diffs, "num_batches_tracked": counts, "differ_from_rank_0": odd,
                                  "sync_batchnorm": is_sync},
                        fix="keep DDP's broadcast_buffers=True (the default), use "
                            "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model), or all_reduce / broadcast the "
                            "buffers yourself before evaluating or saving",
                    ))
            if is_sync or (label, "batch") in self.reported or not all("mean" in s for s in stats.values()):
                continue
            judged = batch_mean_spread(stats)
            spread, channel, typical = judged["worst"], judged["channel"], judged["typical"]
            if disagree(judged):
                self.reported.add((label, "batch"))
                means = {r: round(stats[r]["mean"][channel], 4) for r in sorted(stats)}
                out.append(Finding(
                    severity=Severity.WARNING, detector=self.name, ranks=sorted(stats), step=step, subject=label,
                    message=f"plain BatchNorm {label} normalises each rank's batch with its own statistics, and they "
                            f"disagree at step {step}: by {typical:.2f} standard deviations across ranks over its "
                            f"channels, more than sampling explains for batches of {judged['n']} "
                            f"(about {1 / math.sqrt(judged['n']):.2f}); channel {channel} batch "
                            f"means {means} spread by {spread:.2f} (SyncBatchNorm: not in use)",
                    evidence={"spread_std": spread, "channel": channel, "batch_means": means, "typical_std": typical,
                              "chi2": judged["t"], "dof": judged["dof"], "material_std": MATERIAL_SPREAD,
                              "sync_batchnorm": False},
                    fix="model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping it in DDP "
                        "(statistics over the global batch); or larger per-rank batches / evenly shuffled data",
                ))
        return out

    def before_destroy(self) -> None:
        self.armed = False
        self.close_exchange(clean=True)

    def on_end(self) -> Iterable[Finding]:
        self.close_exchange(clean=False)
        return ()

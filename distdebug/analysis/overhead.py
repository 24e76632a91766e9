"""The in-job A/B's verdict (``attach --measure-overhead``): what the detectors cost this job, with an
interval. Pure over ``overhead_block`` records (runtime.overhead).

Each pair holds one unit of steps with the detectors and one without, neighbours in time: they share the
machine's state (other jobs, frequency, cache, the other ranks' pace), so their difference is the
harness's and the machine's noise cancels within a pair. The overhead is the mean difference over the
pairs divided by the mean step without the harness, with a 95% t-interval from the spread of the pairs'
differences; it is said twice: of the wall time (what the job's steps took) and of the training
thread's CPU time (what the harness's work on that thread added, without the waits for other ranks and
for the OS: the precise figure). The medians and 95th percentiles of all on and all off steps are said
too (a cost that comes every 16th step must not hide behind a mean that is diluted, nor behind a median).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
        2.042)
"""Student's t, 97.5th percentile, for 1 to 30 degrees of freedom (1.96 beyond)."""


def t975(df: int) -> float:
    return T975[df - 1] if 1 <= df <= len(T975) else 1.96


def p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]


def interval(diffs: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval of paired differences (the bounds are the mean with fewer than 2)."""
    m = statistics.fmean(diffs)
    if len(diffs) < 2:
        return m, m, m
    half = t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return m, m - half, m + half


def _relative(pairs: list[dict[str, Any]], on_key: str, off_key: str) -> tuple[float, float, float, float]:
    """(fraction, its 95% bounds, mean off step): the pairs' mean difference over the mean off step."""
    diffs = [statistics.fmean(p[on_key]) - statistics.fmean(p[off_key]) for p in pairs]
    base = statistics.fmean(statistics.fmean(p[off_key]) for p in pairs)
    m, lo, hi = interval(diffs)
    return m / base, lo / base, hi / base, base


def ab(records: list[dict[str, Any]], off_paid_ms: float | None = None) -> dict[str, Any] | None:
    """One rank's A/B from its pairs; None without a complete pair. ``off_paid_ms``: what an off step still
    paid the harness on the training thread (the session's own accounting, analysis.cost.off_paid_ms): the
    difference cannot see it, a run without distdebug does not pay it, so it is added to what the user pays."""
    complete = [r for r in records if r.get("on_s") and r.get("off_s")]
    pairs = [r for r in complete if not r.get("one_off")]  # the steady cost: one-offs are counted apart
    if not pairs:
        return None
    frac, lo, hi, off_mean = _relative(pairs, "on_s", "off_s")
    on = [t for p in pairs for t in p["on_s"]]
    off = [t for p in pairs for t in p["off_s"]]
    out: dict[str, Any] = {
        "fraction": round(frac, 5), "ci": [round(lo, 5), round(hi, 5)],
        "median_fraction": round(statistics.median(on) / statistics.median(off) - 1, 5),
        "p95_fraction": round(p95(on) / p95(off) - 1, 5),
        "per_step_ms": round((statistics.fmean(on) - statistics.fmean(off)) * 1e3, 4),
        "step_ms_off": round(statistics.fmean(off) * 1e3, 4), "step_ms_on": round(statistics.fmean(on) * 1e3, 4),
        "steps": len(on) + len(off), "pairs": len(pairs), "unit": len(pairs[0]["on_s"]),
        "left_out": len(complete) - len(pairs),
    }
    if all(p.get("on_cpu_s") and p.get("off_cpu_s") for p in pairs):
        cfrac, clo, chi, cbase = _relative(pairs, "on_cpu_s", "off_cpu_s")
        out.update(cpu_fraction=round(cfrac, 5), cpu_ci=[round(clo, 5), round(chi, 5)],
                   cpu_per_step_ms=round(cfrac * cbase * 1e3, 4), cpu_step_ms_off=round(cbase * 1e3, 4),
                   cpu_median_ms_off=round(statistics.median(t for p in pairs for t in p["off_cpu_s"]) * 1e3, 4))
    if off_paid_ms is not None:
        residual = round(off_paid_ms, 4)
        seen: float = out.get("cpu_per_step_ms", out["per_step_ms"])
        out.update(off_paid_ms=residual, paid_ms=round(seen + residual, 4))
    return out


def summarize_ab(per_rank: dict[int, list[dict[str, Any]]],
                 off_paid: dict[int, float | None] | None = None) -> dict[str, Any] | None:
    """The job's A/B: rank 0's (or the lowest rank that has one), with every rank's under ``ranks``;
    ``off_paid``: per rank, what its off steps still paid (``ab``)."""
    paid = off_paid or {}
    ranks = {r: v for r, v in ((r, ab(b, paid.get(r))) for r, b in sorted(per_rank.items())) if v is not None}
    if not ranks:
        return None
    first = min(ranks)
    return {**ranks[first], "rank": first, "ranks": {str(r): v for r, v in ranks.items()}}


def describe(o: dict[str, Any]) -> str:
    """``harness overhead +2.1% (95% CI 0.9..3.4%) of the wall time over 640 steps ...; training thread CPU ...``"""
    lo, hi = o["ci"]
    unit = o.get("unit", 1)
    text = (f"harness overhead {o['fraction'] * 100:+.1f}% (95% CI {lo * 100:.1f}..{hi * 100:.1f}%) of the wall time "
            f"over {o['steps']} steps ({o['pairs']} on/off pairs of {unit} step{'s' if unit != 1 else ''}, rank "
            f"{o['rank']}"
            + (f"; {o['left_out']} pair{'s' if o['left_out'] != 1 else ''} with one-off work left out"
               if o.get("left_out") else "")
            + f"), per-step cost {o['per_step_ms']:.3f} ms (mean step {o['step_ms_off']:.2f} ms off, "
            f"{o['step_ms_on']:.2f} ms on)")
    if "cpu_fraction" in o:
        clo, chi = o["cpu_ci"]
        text += (f"; the training thread's CPU time {o['cpu_fraction'] * 100:+.1f}% (95% CI {clo * 100:.1f}.."
                 f"{chi * 100:.1f}%), {o['cpu_per_step_ms']:.3f} ms a step of {o['cpu_step_ms_off']:.2f} ms")
    text += (f"; median step {o['median_fraction'] * 100:+.1f}%, 95th percentile "
             f"{o['p95_fraction'] * 100:+.1f}%")
    if "paid_ms" in o:
        text += (f"; against a run without distdebug {o['paid_ms']:.3f} ms a step on the training thread (the off "
                 f"steps still paid {o['off_paid_ms']:.3f} ms: the session's step counting and record)")
    return text

"""The in-job A/B's verdict (``attach --measure-overhead``): what the detectors cost this job, with an
interval. Pure over ``overhead_block`` records (runtime.overhead).

Each on block is paired with the off block that follows it: neighbours share the machine's state
(other jobs, frequency, cache), so their difference is the harness's and the machine's noise cancels
within a pair. The overhead is the mean of the pairs' relative differences of mean step time, with a
95% t-interval over the pairs; the same is said of the medians and of the 95th percentiles (a cost
that comes every 16th step must not hide behind a median), and the per-step cost is the difference
of the mean step times. A fraction of the step time without the harness.
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


def ab(blocks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One rank's A/B from its blocks; None with no complete on/off pair."""
    by_index = {int(b["block"]): b for b in blocks if b.get("step_times_s")}
    pairs = [(by_index[i], by_index[i + 1]) for i in sorted(by_index)
             if by_index[i].get("on") and i + 1 in by_index and not by_index[i + 1].get("on")]
    if not pairs:
        return None
    on = [t for a, _ in pairs for t in a["step_times_s"]]
    off = [t for _, b in pairs for t in b["step_times_s"]]
    rel = {
        "mean": [statistics.fmean(a["step_times_s"]) / statistics.fmean(b["step_times_s"]) - 1 for a, b in pairs],
        "median": [statistics.median(a["step_times_s"]) / statistics.median(b["step_times_s"]) - 1 for a, b in pairs],
        "p95": [p95(a["step_times_s"]) / p95(b["step_times_s"]) - 1 for a, b in pairs],
    }
    frac, lo, hi = interval(rel["mean"])
    med, med_lo, med_hi = interval(rel["median"])
    tail, tail_lo, tail_hi = interval(rel["p95"])
    return {
        "fraction": round(frac, 5), "ci": [round(lo, 5), round(hi, 5)],
        "median_fraction": round(med, 5), "median_ci": [round(med_lo, 5), round(med_hi, 5)],
        "p95_fraction": round(tail, 5), "p95_ci": [round(tail_lo, 5), round(tail_hi, 5)],
        "per_step_ms": round((statistics.fmean(on) - statistics.fmean(off)) * 1e3, 4),
        "step_ms_off": round(statistics.fmean(off) * 1e3, 4), "step_ms_on": round(statistics.fmean(on) * 1e3, 4),
        "steps": len(on) + len(off), "pairs": len(pairs),
    }


def summarize_ab(per_rank: dict[int, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """The job's A/B: rank 0's (or the lowest rank that has one), with every rank's under ``ranks``."""
    ranks = {r: v for r, v in ((r, ab(b)) for r, b in sorted(per_rank.items())) if v is not None}
    if not ranks:
        return None
    first = min(ranks)
    return {**ranks[first], "rank": first, "ranks": {str(r): v for r, v in ranks.items()}}


def describe(o: dict[str, Any]) -> str:
    """``harness overhead +2.1% (95% CI 0.9..3.4%) over 200 steps, per-step cost 0.61 ms ...``"""
    lo, hi = o["ci"]
    return (f"harness overhead {o['fraction'] * 100:+.1f}% (95% CI {lo * 100:.1f}..{hi * 100:.1f}%) over {o['steps']} "
            f"steps ({o['pairs']} on/off block pairs, rank {o['rank']}), per-step cost {o['per_step_ms']:.3f} ms "
            f"(mean step {o['step_ms_off']:.2f} ms off, {o['step_ms_on']:.2f} ms on); median "
            f"{o['median_fraction'] * 100:+.1f}%, 95th percentile {o['p95_fraction'] * 100:+.1f}%")

"""The harness's cost per step, from each rank's own accounting (runtime.cost), against its median step.

Pure over records: ``per_rank`` takes each rank's last ``harness_cost`` record, its step records and its
profiler windows (``trace`` records). The per-step figures are the steady cost, what staying on costs a
step; what was paid once is apart (``one_off``): start-up (until the end of step 1), each re-execution of a
flagged step (runtime.cost.one_off), and each profiler window (the window's steps' time above the median
step: the training's own slowdown under torch.profiler). ``whole_run_per_step_ms`` spreads them over the
steps, as a whole-run figure would.
What the report shows (``harness cost per step``) and what ``report --json`` carries under
``harness_cost``. Over BUDGET of the median step, the detector that costs most is named with the way
to trade its coverage for time (``TRADE``).
"""

from __future__ import annotations

from typing import Any

from distdebug.runtime.cost import PROFILER_WINDOW, SESSION

BUDGET = 0.03
"""The share of the median step the harness may take before the report says what to turn down."""

TRADE = {
    "replica_divergence": "fingerprint every N steps instead of every step: --fingerprint-every 10 "
                          "(a divergence is then found within N steps)",
    "nan_origin": "leave it out with --detectors=-nan_origin; loss_nonfinite stays (the step and rank of a NaN loss, "
                  "not the module and parameter it started in); a run given --nan-watch full pays a check per "
                  "module per step that the default on-demand watch does not",
    "loss_spike": "leave it out with --detectors=-loss_spike (spikes are then not judged)",
    "data_order": "leave it out with --detectors=-data_order (identical batches across ranks are then not seen)",
    "bn_divergence": "leave it out with --detectors=-bn_divergence (BatchNorm statistics are then not compared)",
    "straggler": "leave it out with --detectors=-straggler (stragglers are then not scored)",
    "memory": "leave it out with --detectors=-memory (the memory breakdown goes)",
    "rerun": "run without --rerun-on-anomaly (a flagged step is then not re-executed: no transient-or-persistent "
             "verdict)",
    "session": "the session's own part (the step's read, the wrappers) is the floor, whatever is turned down",
}


def profiler_windows(times_s: dict[int, float], traces: list[dict[str, Any]],
                     median_ms: float | None) -> list[dict[str, Any]]:
    """Each profiler window's price: what its steps and the one after it took above the median step (ms,
    summed; at least 0). The profiler starts at the boundary before the window's first step and stops, and
    writes its trace, at the boundary after its last, and a step's time runs from boundary to boundary: the
    start is in the first step's time, the stop and the export in the next step's. ``times_s``: step -> its
    time (s), for the windows' steps at least (artifacts.digest keeps those)."""
    if median_ms is None:
        return []
    times = {int(s): float(t) * 1e3 for s, t in times_s.items()}
    out = []
    for t in traces:
        window = t.get("steps") or []
        if len(window) != 2:
            continue
        a, b = int(window[0]), int(window[1])
        inside = [times[s] for s in range(a, b + 2) if s in times]
        out.append({"steps": f"{a}-{b}", "extra_ms": round(max(0.0, sum(x - median_ms for x in inside)), 3)})
    return out


def off_paid_ms(cost: dict[str, Any] | None) -> float | None:
    """What each off step of the in-job A/B still paid the session (ms; None without off steps)."""
    off = int((cost or {}).get("off_steps") or 0)
    if not cost or off <= 0 or "off_session_ms" not in cost:
        return None
    return float(cost["off_session_ms"]) / off


def per_rank(cost: dict[str, Any] | None, median_ms: float | None, times_s: dict[int, float] | None = None,
             traces: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """One rank's steady cost per step (ms) per owner, against its median step time (ms: past step 1, the
    harness on: ``Digest.work_median_ms``), and what it paid once (``times_s``: the profiler windows' step
    times). None without a record."""
    # Steps with the detectors paused (--measure-overhead's off blocks) cost them nothing: not counted.
    n = int((cost or {}).get("steps") or 0) - int((cost or {}).get("off_steps") or 0)
    if not cost or n <= 0:
        return None
    spent = {k: float(v) for k, v in (cost.get("training_thread_ms") or {}).items()}
    if SESSION in spent:  # the session's time in the off steps is theirs, not the steps counted here
        spent[SESSION] = max(0.0, spent[SESSION] - float(cost.get("off_session_ms") or 0.0))
    owners = {k: v / n for k, v in spent.items()}
    threads = {k: float(v) / n for k, v in (cost.get("threads_cpu_ms") or {}).items()}
    total = sum(owners.values())
    startup = sum(float(v) for v in (cost.get("startup_ms") or {}).values())
    once = [{"what": what, "ms": float(v[0]), "times": int(v[1])} for what, v in (cost.get("one_off_ms") or {}).items()
            if what != PROFILER_WINDOW]  # held in each window's price (profiler_windows)
    windows = profiler_windows(times_s or {}, traces or [], median_ms)
    paid_once = startup + sum(x["ms"] for x in once) + sum(w["extra_ms"] for w in windows)
    return {
        "steps": n,
        "median_step_ms": round(median_ms, 4) if median_ms is not None else None,
        "per_step_ms": {k: round(v, 4) for k, v in sorted(owners.items(), key=lambda x: -x[1])},
        "total_per_step_ms": round(total, 4),
        "fraction": round(total / median_ms, 5) if median_ms else None,
        "threads_cpu_per_step_ms": {k: round(v, 4) for k, v in threads.items()},
        "host_reads_per_step": round(int(cost.get("host_reads") or 0) / n, 3),
        "backwards_per_step": round(int(cost.get("backwards") or 0) / max(1, int(cost.get("steps") or 0)), 3),
        "startup_ms": round(startup, 3),
        "one_off": once,
        "profiler_windows": windows,
        "whole_run_per_step_ms": round(total + paid_once / n, 4),
        "whole_run_fraction": round((total + paid_once / n) / median_ms, 5) if median_ms else None,
    }


def summarize_cost(ranks: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The job's view: every rank's figures, the costliest rank's total, and the advice over BUDGET."""
    if not ranks:
        return None
    worst_rank = max(ranks, key=lambda r: ranks[r].get("fraction") or 0.0)
    worst = ranks[worst_rank]
    out: dict[str, Any] = {"ranks": {str(r): v for r, v in sorted(ranks.items())}, "rank": worst_rank,
                           "fraction": worst.get("fraction"), "total_per_step_ms": worst["total_per_step_ms"],
                           "median_step_ms": worst.get("median_step_ms"), "advice": None}
    frac = worst.get("fraction")
    if frac is not None and frac > BUDGET:
        costs = worst["per_step_ms"]
        # The trade is a detector's: the session's own part stays whatever is turned down, so the
        # costliest detector is named (and the session when it costs more, as the floor it is).
        top = next((k for k in costs if k != SESSION), SESSION)
        floor = (f"; the session's own part ({costs[SESSION]:.3f} ms: the step's read, the wrappers) stays"
                 if SESSION in costs and costs[SESSION] > costs.get(top, 0.0) and top != SESSION else "")
        out["advice"] = (f"the harness takes {frac * 100:.1f}% of rank {worst_rank}'s median step "
                         f"({worst['total_per_step_ms']:.3f} of {worst['median_step_ms']:.3f} ms); the costliest "
                         f"detector is {top} ({costs.get(top, 0.0):.3f} ms): "
                         + TRADE.get(top, f"leave it out with --detectors=-{top}") + floor)
    return out

"""What the HTML report draws, as plain JSON-ready data, sized for 1 to 1000+ ranks.

The page must stay readable and small at any scale, so the aggregation happens here, not in the
browser: steps are binned to at most ``MAX_STEPS`` columns; loss curves are one line per rank up
to ``MAX_LINES`` ranks and otherwise a min/median/max band plus the ranks that findings name; the
step-time heatmap and the memory and straggler bars group ranks into at most ``MAX_ROWS`` /
``MAX_BARS`` rows, each showing its group's worst value (the slow rank must not be averaged away).

Works on partial runs (killed, hung): whatever steps each rank recorded are used as they are, and
each rank's last step and status go into the timeline.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from distdebug.analysis.summary import RunSummary
from distdebug.artifacts import layout
from distdebug.artifacts.reader import Run, read_json

MAX_STEPS = 500
MAX_LINES = 16
MAX_ROWS = 128
MAX_BARS = 64
MEMORY_PARTS = ("parameters", "gradients", "optimizer_state", "activations", "other")
BAD = ("error", "critical")


def bins(n: int, limit: int) -> int:
    """Group size that puts n items into at most ``limit`` groups."""
    return max(1, math.ceil(n / limit))


def groups(ranks: list[int], limit: int) -> list[list[int]]:
    size = bins(len(ranks), limit)
    return [ranks[i:i + size] for i in range(0, len(ranks), size)]


def label(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


def _mean_or_nan(values: list[float]) -> float | None:
    """Mean of a bin; NaN when any value is non-finite (a NaN must stay visible after binning)."""
    if not values:
        return None
    total = sum(values)
    if math.isfinite(total):  # the common case, in one pass (a thousand ranks' curves)
        return total / len(values)
    if any(not math.isfinite(v) for v in values):
        return math.nan
    return total / len(values)  # pragma: no cover (finite values whose sum overflows)




def first_bad(findings: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The earliest step with an error or critical finding: where the run first went wrong."""
    bad = [f for f in findings if f["severity"] in BAD and f.get("step") is not None and f["detector"] != "harness"]
    if not bad:
        return None
    step = min(f["step"] for f in bad)
    at = [f for f in bad if f["step"] == step]
    return {"step": step, "detectors": sorted({f["detector"] for f in at}),
            "ranks": sorted({r for f in at for r in f["ranks"]}), "subject": at[0]["subject"]}


def plot_data(run: Run, summary: RunSummary, findings: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything the page draws. ``findings``: the summary's findings as dicts (with advice)."""
    # Each rank's curves from its digest (artifacts.digest): per step up to 512 steps, then bucket means over
    # a power of two of steps; a bin is a whole number of the widest buckets, so each holds whole buckets.
    digests = {rank: s.digest for rank, s in sorted(run.ranks.items())}
    ranks = list(digests)
    loss = {r: d.curve.series("loss") for r, d in digests.items()}
    times = {r: d.curve.series("step_time_s") for r, d in digests.items()}
    last = max((min(max(ts) + d.curve.width - 1, max(d.last_step or 0, max(ts))) for r, d in digests.items()
                if (ts := times[r])), default=0)
    width = max([1] + [d.curve.width for d in digests.values()])
    size = width * math.ceil(bins(last, MAX_STEPS) / width)
    starts = list(range(1, last + 1, size))

    def binned(series: dict[int, float]) -> list[float | None]:
        got: list[list[float]] = [[] for _ in starts]  # by the points there are, not the steps they span
        for s, v in sorted(series.items()):
            if 0 <= (i := (s - 1) // size) < len(got):
                got[i].append(v)
        return [_mean_or_nan(values) for values in got]

    named = sorted({r for f in findings if f["severity"] != "info" for r in f["ranks"] if r in digests})
    rank_loss = {r: binned(loss[r]) for r in ranks}
    if len(ranks) <= MAX_LINES:
        loss_plot: dict[str, Any] = {"mode": "per_rank",
                                     "series": [{"name": f"rank {r}", "rank": r, "y": rank_loss[r]} for r in ranks]}
    else:
        band: dict[str, list[float | None]] = {"min": [], "median": [], "max": []}
        for i in range(len(starts)):
            col = [v for v in (rank_loss[r][i] for r in ranks) if v is not None and math.isfinite(v)]
            band["min"].append(min(col) if col else None)
            band["median"].append(statistics.median(col) if col else None)
            band["max"].append(max(col) if col else None)
        loss_plot = {"mode": "band", "band": band, "ranks": len(ranks),
                     "series": [{"name": f"rank {r}", "rank": r, "y": rank_loss[r]} for r in named[:8]]}

    rows = groups(ranks, MAX_ROWS)
    heat = []
    for g in rows:
        per = [binned(times[r]) for r in g]
        heat.append([max((v for p in per if (v := p[i]) is not None), default=None) for i in range(len(starts))])
    all_times = [v for row in heat for v in row if v is not None and math.isfinite(v)]
    step_time = {"rows": [label(g) for g in rows], "group": len(rows[0]) if rows else 1,
                 "values_ms": [[None if v is None else v * 1000 for v in row] for row in heat],
                 "median_ms": statistics.median(all_times) * 1000 if all_times else None}

    timeline = {
        "events": [{"detector": f["detector"], "severity": f["severity"], "step": f.get("step"),
                    "ranks": f["ranks"][:16], "nranks": len(f["ranks"]), "subject": f["subject"],
                    "message": f["message"][:300]} for f in findings],
        "injected": [{"fault": i.get("fault"), "rank": i.get("rank"), "step": i.get("step")} for i in summary.injected],
        "ends": [{"rank": r.rank, "step": r.steps, "status": r.status} for r in summary.ranks
                 if r.status != "exit 0"][:32],
        "unfinished": sum(1 for r in summary.ranks if r.status != "exit 0"),
    }

    mem_rows = []
    peaks = {r.rank: r.memory_peak for r in summary.ranks if r.memory_peak}
    for g in groups(list(peaks), MAX_BARS):
        worst = max(g, key=lambda r: peaks[r].get("total", 0) or sum(peaks[r].get(k) or 0 for k in MEMORY_PARTS))
        peak = peaks[worst]
        mem_rows.append({"label": label(g) if len(g) == 1 else f"{label(g)} (max: rank {worst})",
                         "step": peak.get("step"), "values": [peak.get(k) or 0 for k in MEMORY_PARTS]})

    scored = [(r.rank, r.straggler_score) for r in summary.ranks if r.straggler_score is not None]
    straggler = None
    if scored:
        by_rank = dict(scored)
        bars = []
        for g in groups([r for r, _ in scored], MAX_BARS):
            worst = min(g, key=lambda r: by_rank[r])
            bars.append({"label": label(g) if len(g) == 1 else f"{label(g)} (min: rank {worst})",
                         "score": by_rank[worst]})
        straggler = {"threshold": 0.7, "rows": bars,
                     "named": [f["ranks"][0] for f in findings if f["detector"] == "straggler" and f["ranks"]]}

    doctor = read_json(layout.doctor_path(Path(run.path)))
    doctor_plot = None
    if doctor and (doctor.get("all_reduce") or doctor.get("links")):
        links = doctor.get("links") or {}
        n = int(doctor.get("world_size") or 0)
        flagged = [f["ranks"] for f in findings if f["detector"] == "link_matrix"]
        matrix = [[None if a == b else (links.get("bandwidth_GBps") or {}).get(f"{min(a, b)}-{max(a, b)}")
                   for b in range(n)] for a in range(n)] if links else None
        doctor_plot = {"backend": doctor.get("backend"), "world_size": n, "sweep": doctor.get("all_reduce") or [],
                       "matrix": matrix, "flagged": flagged}

    windows = [{"steps": w.get("steps"), "dir": w["dir"], "summary": w["summary"], "verdicts": w["verdicts"],
                "traces": [{"rank": int(r), "path": v.get("path"), "error": v.get("error")}
                           for r, v in sorted(w["ranks"].items())]} for w in summary.windows]

    return {
        "steps": {"starts": starts, "bin": size, "last": last},
        "first_bad": first_bad(findings),
        "loss": loss_plot,
        "step_time": step_time,
        "timeline": timeline,
        "memory": {"parts": list(MEMORY_PARTS), "rows": mem_rows},
        "straggler": straggler,
        "doctor": doctor_plot,
        "windows": windows,
    }

"""Analysis of profiler windows (``traces/steps-A-B/rank-N.pt.trace.json.gz``): per rank and step,
how much of the step went to communication, how much of that overlapped computation, how much to
waiting for the data loader, and which operators took the time.

Stages: load (torch's Chrome trace JSON, gzip or not) -> intervals -> numbers -> verdicts. What
counts as what, read from the events torch writes:

- steps: ``ProfilerStep#N`` annotations (the attach profiler numbers them by optimizer step), the
  window's complete steps only: what follows the job's last step is no step (``real_steps``);
- communication: on GPU the NCCL kernels (``cat`` kernel, name containing ``nccl``); on CPU the
  gloo work annotations (``gloo:all_reduce`` ..., which span a collective from enqueue to done);
- computation: on GPU every other kernel; on CPU the operators of the training thread (the thread
  of the step marks), collective enqueues (``c10d::``) left out;
- data loader: ``enumerate(DataLoader)#...`` annotations.

Overlap ratio = time communication and computation run together / communication time (a common
rule: 70% or more is healthy, under 50% communication blocks computation). Intervals of one kind
are merged first, so nested operators are not counted twice.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import statistics
from pathlib import Path
from typing import Any

from distdebug.artifacts import layout

HEALTHY_OVERLAP = 0.7
BLOCKING_OVERLAP = 0.5
DATA_SHARE = 0.2
STEP_RE = re.compile(r"ProfilerStep#(\d+)$")

Interval = tuple[float, float]


def load_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:  # type: ignore[operator]
        return json.load(f)


def merge(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(x: list[Interval], y: list[Interval]) -> list[Interval]:
    """Intersection of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def real_steps(trace: dict[str, Any], named: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """The ``ProfilerStep#N`` marks of ``trace`` that are whole steps: [A, B], or None for all of them.

    A job that ends inside a window leaves one more mark after its last step (torch's profiler opens
    the next mark at each step's end): its end (a save, destroy_process_group, the rest of the script)
    or the unfinished step that raised. The profiler records the complete steps in the trace
    (``distdebug_window``); a trace written before it did is cut by its directory's name (``named``,
    the steps it covers); a trace of no window of ours keeps every mark. (A, A - 1): none completed."""
    record = trace.get(layout.TRACE_WINDOW_KEY)
    if isinstance(record, dict) and isinstance(record.get("steps"), list):
        done = record["steps"]
        if len(done) == 2:
            return int(done[0]), int(done[1])
        planned = record.get("planned") or [0]
        return int(planned[0]), int(planned[0]) - 1
    return named


def analyze_trace(trace: dict[str, Any], top: int = 10, named: tuple[int, int] | None = None) -> dict[str, Any]:
    """Per step and for the whole window of one rank's trace (times in microseconds). Only whole steps
    count (``real_steps``): the marks after them are listed in ``left_out``, and operators are counted
    inside the whole steps only."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    keep = real_steps(trace, named)
    steps, left_out = {}, {}
    main_tid = None
    for e in events:
        m = STEP_RE.match(str(e.get("name", "")))
        if m:
            n, span = int(m.group(1)), (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            if keep is None or keep[0] <= n <= keep[1]:
                steps[n] = span
            else:
                left_out[n] = span
            main_tid = e.get("tid")
    # Operators and kernels are counted by where they start: inside a whole step. (A kernel of the
    # last step that runs after its host-side mark is left out, as at a window's planned end.)
    spans = merge(list(steps.values()))
    starts = [a for a, _ in spans]

    def in_steps(t: float) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and t < spans[i][1]

    gpu = any(e.get("cat") == "kernel" for e in events)
    comm: list[tuple[float, float]] = []
    compute: list[tuple[float, float]] = []
    data: list[tuple[float, float]] = []
    ops: dict[str, Any] = {}
    for e in events:
        name, cat = str(e.get("name", "")), e.get("cat")
        iv = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if name.startswith("enumerate(DataLoader)#"):
            data.append(iv)
        elif gpu and cat == "kernel":
            (comm if "nccl" in name.lower() else compute).append(iv)
        elif not gpu and cat == "user_annotation" and name.startswith("gloo:"):
            comm.append(iv)
        elif cat == "cpu_op" and e.get("tid") == main_tid:
            if not gpu and not name.startswith("c10d::"):
                compute.append(iv)
        if cat in ("cpu_op", "kernel") and not STEP_RE.match(name) and in_steps(iv[0]):
            total, count = ops.get(name, (0.0, 0))
            ops[name] = (total + float(e["dur"]), count + 1)
    comm, compute, data = merge(comm), merge(compute), merge(data)
    rows = []
    for n, span in sorted(steps.items()):
        window = [span]
        c = intersect(comm, window)
        rows.append({
            "step": n, "step_us": span[1] - span[0], "comm_us": length(c),
            "overlap_us": length(intersect(c, intersect(compute, window))),
            "compute_us": length(intersect(compute, window)), "data_us": length(intersect(data, window)),
        })
    total = {k: sum(r[k] for r in rows) for k in ("step_us", "comm_us", "overlap_us", "compute_us", "data_us")}
    return {
        "device": "gpu" if gpu else "cpu",
        "steps": rows,
        "left_out": [{"mark": n, "us": b - a} for n, (a, b) in sorted(left_out.items())],
        "overlap_ratio": total["overlap_us"] / total["comm_us"] if total["comm_us"] else None,
        "comm_share": total["comm_us"] / total["step_us"] if total["step_us"] else None,
        "data_share": total["data_us"] / total["step_us"] if total["step_us"] else None,
        "compute_share": total["compute_us"] / total["step_us"] if total["step_us"] else None,
        "top_ops": [{"name": k, "total_us": round(v[0], 3), "count": v[1]}
                    for k, v in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def _verdicts(summary: dict[str, Any]) -> list[str]:
    out = []
    overlap = summary.get("overlap_ratio")
    if overlap is not None and overlap < BLOCKING_OVERLAP:
        out.append(f"communication blocks computation: only {overlap:.0%} of communication overlaps compute "
                   f"(healthy: {HEALTHY_OVERLAP:.0%} or more); larger DDP buckets, fewer small collectives, "
                   "or overlap-friendly ordering")
    data = summary.get("data_share")
    if data is not None and data > DATA_SHARE:
        out.append(f"data loading takes {data:.0%} of the step: more DataLoader workers, pin_memory, prefetching")
    return out


def analyze_window(directory: Path) -> dict[str, Any]:
    """One window (all ranks' traces in ``directory``): per rank, a summary across ranks and verdicts."""
    ranks: dict[int, dict[str, Any]] = {}
    named = layout.trace_window_of_dir(directory.name)
    for rank, path in layout.trace_files(directory):
        try:
            result = analyze_trace(load_trace(path), top=5, named=named)
        except (OSError, ValueError, EOFError) as e:  # a trace cut by a kill: say so, keep the others
            result = {"error": f"{type(e).__name__}: {e}"}
        result["path"] = str(path)
        ranks[rank] = result
    ok = [r for r in ranks.values() if "error" not in r]
    summary: dict[str, Any] = {}
    for key in ("overlap_ratio", "comm_share", "data_share", "compute_share"):
        values = [r[key] for r in ok if r.get(key) is not None]
        summary[key] = statistics.median(values) if values else None
        summary[f"{key}_min"] = min(values) if values else None
        summary[f"{key}_max"] = max(values) if values else None
    verdicts = _verdicts(summary)
    if ok and not any(r["steps"] for r in ok):  # "healthy" would be a verdict on nothing
        verdicts = [f"no complete step: the job ended inside step {named[0] if named else '?'}, before the "
                    "window's first step finished (nothing measured)"]
    return {"steps": list(named) if named else None, "dir": str(directory),
            "ranks": ranks, "summary": summary, "verdicts": verdicts}


def analyze_run(run_dir: Path) -> list[dict[str, Any]]:
    return [analyze_window(d) for _, d in layout.trace_windows(run_dir)]

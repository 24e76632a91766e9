"""Straggler: a rank that the others keep waiting for, and whether it computes slower or waits for data.

Why arrival times and not step times: in synchronous training every rank's step takes as long as
the slowest rank's, so step times are equal. What differs is *when each rank arrives* at the points
where ranks synchronise: the model's forward (DDP broadcasts buffers there) and backward (the
gradient reduction). Each rank records, per step, the monotonic time of its first forward and first
backward call, its step boundary, and the time it spent inside ``DataLoader.__next__``. Rank 0 gets
them (``runtime.exchange``, in the background, at steps 2, 4, 8 and every 16) and computes, per step:

- lateness of a rank = how long after the earliest rank it arrived (the larger of the two points:
  without a synchronisation between them one delay shows at both);
- wait of a rank = how long it waited for the last one (likewise); its *work* = step time - wait;
- the relative score (as NVIDIA's resiliency extension): fastest rank's median work over this
  rank's median work (1.0 = as fast as the fastest).

Clocks are aligned by the step boundaries (every rank leaves the gradient reduction together), so
nodes need no common clock. A rank whose score stays under SCORE (medians over at least MIN_STEPS
steps) and whose median lateness is at least LATE_FRACTION of the step (and MIN_LATE_S) is a
straggler; its cause is "waits for data" when its extra time in the data loader explains at least
half of its lateness, else "computes slower". Rank 0 also writes the scores (``straggler_scores``).

Not seen: slowness inside backward (the reduction hides who was last there); a GPU that is slower
is usually slower in forward too.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.runtime.exchange import ExchangeUser, checked_step

SCORE = 0.7
LATE_FRACTION = 0.2
MIN_LATE_S = 0.001
MIN_STEPS = 8
WINDOW = 64


def scores(per_rank: dict[int, list[list[float]]]) -> dict[int, dict[str, float]]:
    """Per rank: score, median work, lateness and data wait (s) over the steps every rank recorded.

    ``per_rank[rank]`` holds ``[step, step_time_s, boundary_t, forward_t, backward_t, data_s]`` rows
    (times from time.monotonic, NaN when not seen). Pure; tested on synthetic rows.
    """
    by_step: dict[int, dict[int, list[float]]] = {}
    for rank, rows in per_rank.items():
        for row in rows:
            by_step.setdefault(int(row[0]), {})[rank] = row
    ranks = sorted(per_rank)
    steps = sorted(s for s, d in by_step.items() if len(d) == len(ranks))[-WINDOW:]
    if len(ranks) < 2 or len(steps) < MIN_STEPS:
        return {}
    ref = ranks[0]
    offset = {r: statistics.median(by_step[s][r][2] - by_step[s][ref][2] for s in steps) for r in ranks}
    work: dict[int, list[float]] = {r: [] for r in ranks}
    late: dict[int, list[float]] = {r: [] for r in ranks}
    data: dict[int, list[float]] = {r: [] for r in ranks}
    step_time: list[float] = []
    for s in steps:
        at_step = by_step[s]
        lateness = {r: 0.0 for r in ranks}
        waits = {r: 0.0 for r in ranks}
        for col in (3, 4):  # forward entry, backward entry
            arrivals = {r: at_step[r][col] - offset[r] for r in ranks if at_step[r][col] == at_step[r][col]}
            if len(arrivals) < len(ranks):
                continue
            first, last = min(arrivals.values()), max(arrivals.values())
            for r, t in arrivals.items():
                # The larger of the two points, not their sum: without a synchronisation between them
                # the same delay shows at both (a lower bound when there was one).
                lateness[r] = max(lateness[r], t - first)
                waits[r] = max(waits[r], last - t)
        step = statistics.median(at_step[r][1] for r in ranks)
        step_time.append(step)
        for r in ranks:
            work[r].append(max(step - waits[r], 1e-9))
            late[r].append(lateness[r])
            data[r].append(at_step[r][5])
    med_work = {r: statistics.median(v) for r, v in work.items()}
    fastest = min(med_work.values())
    return {r: {"score": fastest / med_work[r], "work_s": med_work[r], "lateness_s": statistics.median(late[r]),
                "data_wait_s": statistics.median(data[r]), "step_s": statistics.median(step_time),
                "steps": len(steps)} for r in ranks}


def verdicts(table: dict[int, dict[str, float]]) -> list[tuple[int, str, dict[str, float]]]:
    """(rank, cause, its row) for each straggler in a score table; cause 'data' or 'compute'."""
    out = []
    for r, row in table.items():
        if row["score"] >= SCORE or row["lateness_s"] < max(LATE_FRACTION * row["step_s"], MIN_LATE_S):
            continue
        others = [o["data_wait_s"] for q, o in table.items() if q != r]
        extra_data = row["data_wait_s"] - (statistics.median(others) if others else 0.0)
        out.append((r, "data" if extra_data >= 0.5 * row["lateness_s"] else "compute", row))
    return out


class Straggler(ExchangeUser, Detector):
    name = "straggler"
    description = ("a rank the others keep waiting for (relative speed score from arrival times), and whether it "
                   "computes slower or waits for its data loader")

    def __init__(self) -> None:
        self.ctx: RankContext | None = None
        self.exchange: Any = None
        self.rows: list[list[float]] = []
        self.history: dict[int, deque[list[float]]] = {}
        self.forward_t = float("nan")
        self.data_s = 0.0
        self.reported: set[int] = set()
        self._hooks: list[Any] = []

    def setup(self, ctx: RankContext) -> None:
        self.ctx = ctx
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        det = self

        def make(original: Any) -> Any:
            def __next__(it: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return original(it)
                finally:
                    det.data_s += time.perf_counter() - t0
            return __next__

        self.patch(ctx, _BaseDataLoaderIter, "__next__", make)

    def attach(self, ctx: RankContext) -> None:

        self.ctx = ctx
        if ctx.models and self.open_exchange(ctx):
            self.hook(ctx.models[0], "forward_pre", self._pre)

    def _pre(self, module: Any, args: Any) -> None:
        if self.forward_t != self.forward_t:  # NaN: the step's first forward
            self.forward_t = time.monotonic()

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        now = time.monotonic()
        backward_t = self.ctx.backward_t if self.ctx is not None and self.ctx.backward_t is not None else float("nan")
        if backward_t == backward_t and now - backward_t > event.step_time_s + 1.0:
            backward_t = float("nan")  # left from an earlier step
        row = [event.step, event.step_time_s, now, self.forward_t, backward_t, self.data_s]
        self.forward_t, self.data_s = float("nan"), 0.0
        if self.exchange is None or event.step < 2:  # step 1 holds start-up and discovery
            return ()
        self.rows.append(row)
        self.last_step = event.step
        if checked_step(event.step):
            self.flush_pending()
        return ()

    def _judge(self, gathered: list[Any]) -> None:  # on the exchange's thread
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        if ctx.rank != 0:
            return
        for rank, rows in enumerate(gathered):
            self.history.setdefault(rank, deque(maxlen=WINDOW)).extend(rows or [])
        table = scores({r: list(h) for r, h in self.history.items()})
        if not table:
            return
        step = max(int(r[0]) for h in self.history.values() for r in h)
        ctx.emit("straggler_scores", step=step, ranks={str(r): {k: round(v, 6) for k, v in row.items()}
                                                            for r, row in table.items()})
        for rank, cause, row in verdicts(table):
            if rank in self.reported:
                continue
            self.reported.add(rank)
            what = ("waits for data: its data loader takes {:.1f} ms per step, the others' {:.1f} ms".format(
                row["data_wait_s"] * 1000, statistics.median(
                    o["data_wait_s"] for q, o in table.items() if q != rank) * 1000)
                    if cause == "data" else
                    "computes slower (its data loader is not the cause: {:.1f} ms per step)".format(
                        row["data_wait_s"] * 1000))
            ctx.report(Finding(
                severity=Severity.WARNING, detector=self.name, ranks=[rank], step=step,
                subject="data loader" if cause == "data" else "compute",
                message=f"rank {rank} is a straggler: the others wait {row['lateness_s'] * 1000:.1f} ms for it per "
                        f"step of {row['step_s'] * 1000:.1f} ms (relative speed score {row['score']:.2f} < {SCORE}, "
                        f"medians over {int(row['steps'])} steps); it {what}",
                evidence={"cause": "data loader" if cause == "data" else "compute",
                          "scores": {str(r): round(t["score"], 3) for r, t in table.items()},
                          **{k: round(v, 6) for k, v in row.items()}},
                fix=("more DataLoader workers, pin_memory, faster storage or a prefetching loader on that rank's host"
                     if cause == "data" else
                     "look at that rank's host and device: thermal throttling, a noisy neighbour, another process "
                     "on its GPU, a slower card; profile it with --profile-steps"),
            ))

    def flush_pending(self) -> None:
        mine, self.rows = self.rows, []
        self.exchange.post(mine, self._judge)

    def on_end(self) -> Iterable[Finding]:
        self.close_exchange(clean=False)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return ()

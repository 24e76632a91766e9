"""Straggler: a rank that the others keep waiting for, and whether it computes slower or waits for data.

Why arrival times and not step times: in synchronous training every rank's step takes as long as
the slowest rank's, so step times are equal. What differs is *when each rank arrives* at the points
where ranks synchronise: the model's forward (DDP broadcasts buffers there) and backward (the
gradient reduction). Each rank records, per step, the monotonic time of its first forward and of its
first backward that reduces (``ctx.backward_t``: under ``no_sync()`` accumulation, the syncing one), its
step boundary, and the time it spent inside ``DataLoader.__next__``. Rank 0 gets
them (``runtime.exchange``, in the background, at steps 2, 4, 8 and every 16) and computes, per step:

- lateness of a rank = how long after the earliest rank it arrived (the larger of the two points:
  without a synchronisation between them one delay shows at both);
- wait of a rank = how long it waited for the last one (likewise); its *work* = step time - wait;
- the relative score (as NVIDIA's resiliency extension): fastest rank's median work over this
  rank's median work (1.0 = as fast as the fastest).

Clocks are aligned by the step boundaries (every rank leaves the gradient reduction together), so
nodes need no common clock. A rank whose score stays under SCORE (medians over at least MIN_STEPS
steps) and whose median lateness is at least LATE_FRACTION of the step (and MIN_LATE_S, times the
number of ranks that share each core where a host runs more ranks than it has cores) is a
straggler; its cause is "waits for data" when its extra time in the data loader explains at least
half of its lateness, else "computes slower". Rank 0 also writes the scores (``straggler_scores``).

Not seen: slowness inside backward (the reduction hides who was last there); a GPU that is slower
is usually slower in forward too. In a pipeline, stages start their forward one after another by
design: only the ranks that run the same stage (its replicas in other pipelines) are compared, and
a pipeline without replicas has no straggler verdict.

Host timestamps cannot see a slow GPU: the CPU enqueues kernels and runs ahead, and with NCCL it
waits for the device only at a host synchronisation. So where the model lives on CUDA, the forward
is also timed on the device: a CUDA event (``torch.cuda.Event(enable_timing=True)``) is recorded at
the start and at the end of the step's first forward of the model inside the wrapper (DDP's own
buffer broadcast left out), on the current stream, and the events are resolved only at the checked
steps (one ``synchronize`` of the newest event, then ``elapsed_time``). When every rank has device
times for the compared steps, a rank's work is its device forward time and its lateness is how much
longer that took than the fastest rank's; the scores record ``"clock": "device"``. On CPU the host
clock is the device clock and the arrival times are used (``"clock": "host"``). The event source is
``DeviceClock``: tests inject one.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from distdebug.artifacts import schema
from distdebug.cards.straggler import CARD
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.runtime.exchange import ExchangeUser, checked_step

SCORE = 0.7
STAND_OUT = 0.75
"""A straggler's score is also under this fraction of the other ranks' median score: it stands out from its
peers, not only from the fastest. Where ranks share cores (4 ranks on 2), the OS's scheduling spreads
healthy ranks' scores from 0.6 to 1.0 (a clean 4-rank HSDP x TP run named its rank 3 at 0.60 while the
others had 0.73, 0.68 and 1.0); a rank sleeping 50 ms a step scores 0.14 against its peers' 1.0."""
DEVICE = 6
"""Index of the device forward time (s, NaN when not measured) in a row."""
LATE_FRACTION = 0.2
MIN_LATE_S = 0.010
"""Lateness below this is never a straggler, whatever its share of the step: it is what one or two
OS scheduling timeslices (a few ms each) cost a process on a shared host, which says nothing about
the rank. Seen as false alarms when it was 1 ms: 2 ranks and one busy process on 2 cores, steps of
9 ms, one rank 3.4 ms late on median (issue 23). Device times (CUDA events) know no host scheduler:
there the floor is MIN_DEVICE_LATE_S."""
MIN_DEVICE_LATE_S = 0.001
MIN_STEPS = 8
WINDOW = 64


def scores(per_rank: dict[int, Any]) -> dict[int, dict[str, Any]]:
    """Per rank: score, median work, lateness and data wait (s) over the steps every rank recorded.

    ``per_rank[rank]`` holds ``[step, step_time_s, boundary_t, forward_t, backward_t, data_s]`` rows
    (times from time.monotonic, NaN when not seen), optionally with a 7th column: the step's forward
    time on the device (s). Pure; tested on synthetic rows.
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
    device = all(len(by_step[s][r]) > DEVICE and by_step[s][r][DEVICE] == by_step[s][r][DEVICE]
                 for s in steps for r in ranks)
    if device:
        # The CPU ran ahead of a slow device: its host arrival times say nothing. The device's own
        # forward times do: work is that time, lateness its excess over the fastest rank's.
        for i, s in enumerate(steps):
            fwd = {r: by_step[s][r][DEVICE] for r in ranks}
            quickest = min(fwd.values())
            for r in ranks:
                work[r][i] = max(fwd[r], 1e-9)
                late[r][i] = fwd[r] - quickest
    med_work = {r: statistics.median(v) for r, v in work.items()}
    fastest = min(med_work.values())
    return {r: {"score": fastest / med_work[r], "work_s": med_work[r], "lateness_s": statistics.median(late[r]),
                "data_wait_s": statistics.median(data[r]), "step_s": statistics.median(step_time),
                "steps": len(steps), "clock": "device" if device else "host"} for r in ranks}


def by_position(per_rank: dict[int, Any], stages: dict[int, int | None], floor_s: float = MIN_LATE_S
                ) -> tuple[dict[int, dict[str, Any]], list[tuple[int, str, dict[str, Any]]]]:
    """``scores`` and ``verdicts`` among the ranks that run the same pipeline stage (every rank together
    outside a pipeline): stages arrive one after another by design, since a stage's first forward
    waits for the previous stage's activations. Pure."""
    groups: dict[int | None, list[int]] = {}
    for rank in sorted(per_rank):
        groups.setdefault(stages.get(rank), []).append(rank)
    table: dict[int, dict[str, Any]] = {}
    found: list[tuple[int, str, dict[str, Any]]] = []
    for group in groups.values():
        part = scores({r: per_rank[r] for r in group})
        table.update(part)
        found += verdicts(part, floor_s)
    return table, found


class DeviceClock:
    """Device-side timestamps: CUDA events on the current stream, resolved only when asked (at checked
    steps: one synchronize of the newest event). Tests inject another source with the same three calls."""

    def __init__(self) -> None:
        import torch

        self._event = torch.cuda.Event

    def mark(self) -> Any:
        event = self._event(enable_timing=True)
        event.record()
        return event

    def settle(self, token: Any) -> None:
        token.synchronize()

    def elapsed(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1000.0


def host_floor(local_world: int, cores: int) -> float:
    """The host-clock lateness floor on a host where ``local_world`` CPU-bound ranks share ``cores``
    cores: each rank then waits for a core about one timeslice per rank that shares it, every step,
    which says nothing about the rank (4 ranks on 2 cores: a healthy rank was 10.3 ms late on median
    in 36 ms steps)."""
    return MIN_LATE_S * max(1, -(-local_world // max(cores, 1)))


def verdicts(table: dict[int, dict[str, Any]], floor_s: float = MIN_LATE_S) -> list[tuple[int, str, dict[str, Any]]]:
    """(rank, cause, its row) for each straggler in a score table; cause 'data' or 'compute'.
    ``floor_s``: the host-clock lateness floor (``host_floor``)."""
    out = []
    for r, row in table.items():
        floor = MIN_DEVICE_LATE_S if row.get("clock") == "device" else floor_s
        others = [o["data_wait_s"] for q, o in table.items() if q != r]
        extra_data = row["data_wait_s"] - (statistics.median(others) if others else 0.0)
        peers = statistics.median(o["score"] for q, o in table.items() if q != r) if len(table) > 1 else 1.0
        if row["score"] >= SCORE or row["score"] >= STAND_OUT * peers or \
                row["lateness_s"] < max(LATE_FRACTION * row["step_s"], floor):
            # Arrival times equal, but this rank's data loader takes a fifth of the step more than the others':
            # they wait for it at a synchronisation between loading and forward (the HF Trainer gathers the
            # batch's token count there), where arrival times no longer show who was late (issue 22).
            if extra_data >= max(LATE_FRACTION * row["step_s"], floor_s):
                out.append((r, "data-sync", row))
            continue
        out.append((r, "data" if extra_data >= 0.5 * row["lateness_s"] else "compute", row))
    return out


class Straggler(ExchangeUser, Detector):
    name = "straggler"
    needs_model = True
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    def __init__(self, clock: Any = None) -> None:
        self.ctx: RankContext | None = None
        self.exchange: Any = None
        self.clock = clock  # DeviceClock where the model is on CUDA (attach); injected by tests
        self.marks: list[Any] = []  # this step's device events: forward start, forward end
        self.pending_device: list[tuple[int, Any, Any]] = []  # rows (by place) whose device times are unresolved
        self.rows: list[tuple[float, ...]] = []
        """Tuples of numbers: kept for up to 16 steps, a list each would be an object the interpreter's collector
        promotes and a full collection walks; such a tuple it stops tracking (issue 62)."""
        self.history: dict[int, deque[tuple[float, ...]]] = {}
        self.stages: dict[int, int | None] = {}  # rank -> its pipeline stage (None: not a pipeline)
        self.floor_s = MIN_LATE_S  # the host-clock lateness floor on this host (attach: host_floor)
        self.forward_t = float("nan")
        self.data_s = 0.0
        self.reported: set[int] = set()

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
        import os

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.floor_s = host_floor(ctx.identity.local_world_size, cores)
        if ctx.models and self.open_exchange(ctx):
            root = ctx.models[0]
            self.hook(root, "forward_pre", self._pre)
            from distdebug.runtime.discovery import unwrap

            inner = unwrap(root)[0]
            if self.clock is None and any(p.is_cuda for p in inner.parameters()):
                self.clock = DeviceClock()
            if self.clock is not None:
                # Inside the wrapper: DDP's buffer broadcast (a collective wait) is not the device's work.
                self.hook(inner, "forward_pre", self._device_start)
                self.hook(inner, "forward", self._device_end)

    def _pre(self, module: Any, args: Any) -> None:
        if self.forward_t != self.forward_t:  # NaN: the step's first forward
            self.forward_t = time.monotonic()

    def _device_start(self, module: Any, args: Any) -> None:
        if not self.marks and self.clock is not None:  # the step's first forward only
            self.marks.append(self.clock.mark())

    def _device_end(self, module: Any, args: Any, out: Any) -> None:
        if len(self.marks) == 1 and self.clock is not None:
            self.marks.append(self.clock.mark())

    def _resolve_device(self) -> None:
        """At a checked step: wait for the newest event once, then read every pending row's time."""
        if not self.pending_device or self.clock is None:
            return
        self.clock.settle(self.pending_device[-1][2])
        for at, start, end in self.pending_device:
            row = self.rows[at]
            self.rows[at] = (*row[:DEVICE], self.clock.elapsed(start, end), *row[DEVICE + 1:])
        self.pending_device = []

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        now = time.monotonic()
        backward_t = self.ctx.backward_t if self.ctx is not None and self.ctx.backward_t is not None else float("nan")
        if backward_t == backward_t and now - backward_t > event.step_time_s + 1.0:
            backward_t = float("nan")  # left from an earlier step
        row = (event.step, event.step_time_s, now, self.forward_t, backward_t, self.data_s, float("nan"))
        marks, self.marks = self.marks, []
        self.forward_t, self.data_s = float("nan"), 0.0
        if self.exchange is None or event.step < 2:  # step 1 holds start-up and discovery
            return ()
        if len(marks) == 2:
            self.pending_device.append((len(self.rows), marks[0], marks[1]))
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
        for rank, part in enumerate(gathered):
            stage, rows = part or (None, [])  # (its pipeline stage or None, its rows): what flush_pending posts
            self.stages[rank] = stage
            self.history.setdefault(rank, deque(maxlen=WINDOW)).extend(rows or [])
        table, found = by_position({r: list(h) for r, h in self.history.items()}, self.stages, self.floor_s)
        if not table:
            return
        step = max(int(r[0]) for h in self.history.values() for r in h)
        ctx.emit(schema.STRAGGLER_SCORES, step=step, ranks={str(r): {k: round(v, 6) if isinstance(v, float) else v
                                                                for k, v in row.items()}
                                                            for r, row in table.items()})
        for rank, cause, row in found:
            if rank in self.reported:
                continue
            self.reported.add(rank)
            others_ms = statistics.median(o["data_wait_s"] for q, o in table.items() if q != rank) * 1000
            what = ("waits for data: its data loader takes {:.1f} ms per step, the others' {:.1f} ms".format(
                row["data_wait_s"] * 1000, others_ms)
                    if cause != "compute" else
                    "computes slower (its data loader is not the cause: {:.1f} ms per step)".format(
                        row["data_wait_s"] * 1000))
            if cause == "data-sync":
                message = (f"rank {rank} is a straggler: its data loader takes {row['data_wait_s'] * 1000:.1f} ms per "
                           f"step of {row['step_s'] * 1000:.1f} ms, the others' {others_ms:.1f} ms, and the others "
                           "wait for it at a synchronisation between loading and the forward (a collective there: "
                           "their arrival times are equal, medians over "
                           f"{int(row['steps'])} steps)")
            else:
                message = (f"rank {rank} is a straggler: the others wait {row['lateness_s'] * 1000:.1f} ms for it per "
                           f"step of {row['step_s'] * 1000:.1f} ms (relative speed score {row['score']:.2f} < {SCORE}, "
                           f"medians over {int(row['steps'])} steps); it {what}")
            ctx.report(Finding(
                severity=Severity.WARNING, detector=self.name, ranks=[rank], step=step,
                subject="compute" if cause == "compute" else "data loader",
                message=message,
                evidence={"cause": "compute" if cause == "compute" else "data loader",
                          "scores": {str(r): round(t["score"], 3) for r, t in table.items()},
                          **{k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}},
                fix=("more DataLoader workers, pin_memory, faster storage or a prefetching loader on that rank's host"
                     if cause != "compute" else
                     "look at that rank's host and device: thermal throttling, a noisy neighbour, another process "
                     "on its GPU, a slower card; profile it with --profile-steps"),
            ))

    def handover(self, successor: Detector) -> None:
        """The ranks' speeds are the job's, not the model's: a new training phase goes on with the rows
        gathered so far (rank 0's history, what is not posted yet), so a slow rank is judged over both."""
        if not isinstance(successor, Straggler):
            return  # (rows still waiting for their device times keep them unknown: no wait for the device here)
        successor.history, successor.stages, successor.reported = self.history, self.stages, self.reported
        successor.rows, self.rows, self.pending_device = self.rows, [], []

    def flush_pending(self) -> None:
        self._resolve_device()
        mine, self.rows = self.rows, []
        layout = getattr(self.ctx, "layout", None)
        stage = getattr(layout, "stage", None)
        self.exchange.post((stage["index"] if stage else None, mine), self._judge)

    def on_end(self) -> Iterable[Finding]:
        self.close_exchange(clean=False)
        return ()

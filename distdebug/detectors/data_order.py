"""DataOrder: ranks that train on the same batches, epochs that repeat their order, and ranks that see
the same batch but compute different losses.

- Each rank fingerprints the input of its model's first forward in every step (xxh3 on CPU, a
  device-side fingerprint on GPU: no copy to the host). At steps 2, 4, 8 and every 16 steps the
  ranks exchange (step, batch fingerprint, loss) since the last check in one small all_gather, in
  the background (``runtime.exchange``): training never waits for it.
- Every rank holding the same batch in every checked step means DistributedSampler (or any
  sharding) is missing: each rank repeats the others' work. When that is meant (a first
  debugging stage: two ranks, the same data, losses must agree), the losses are compared: the same batch
  with losses apart by more than 1e-5 (relative) means the replicas differ.
- ``DistributedSampler(shuffle=True)`` trained on again with an epoch already trained on repeats that
  epoch's order exactly (``set_epoch`` not called): found from the sampler itself (its ``__iter__`` is
  watched from the script's first line, ``SamplerPasses``), with the file and line of the loop.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from distdebug.cards.data_order import CARD
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.fingerprint.pending import PendingFingerprints, finish_read, rows_to_read
from distdebug.runtime.callsite import user_line
from distdebug.runtime.discovery import first_tensor
from distdebug.runtime.exchange import ExchangeUser
from distdebug.runtime.exchange import checked_step as checked
from distdebug.runtime.layout import partition

MIN_STEPS = 3
HISTORY = 256
"""Steps of each rank's batch fingerprints kept for judging (the newest): the verdicts read these, and a job's
memory and the judging at a check must not grow with its length. "The same batch on every rank" is judged over
them: a run whose first steps were sharded and whose last 256 are not is told (it once never was)."""
LOSS_RTOL = 1e-5
LIVE_PASSES = 16
"""Unfinished passes kept for judging, at most (epochs cut short never finish: the oldest are let go)."""
MAX_EPOCHS = 256
"""Epochs remembered per sample order (a repeat of an older one is not told)."""
MAX_ORDERS = 64
"""Sample orders (dataset, seed, ranks) remembered, and repeats waiting to be told."""


class Pass:
    """One iteration of a DistributedSampler: ``iter(sampler)``, as the DataLoader's iterator starts it."""

    __slots__ = ("done", "epoch", "grad", "key", "shuffle", "step", "tick", "where")

    def __init__(self, key: tuple[Any, ...], epoch: int, shuffle: bool, where: str) -> None:
        self.key, self.epoch, self.shuffle, self.where = key, epoch, shuffle, where
        self.tick = 0  # SamplerPasses.tick at its latest index
        self.done = False  # ran to its end
        self.step: int | None = None  # the first step it was trained on
        self.grad = False  # an index of it was taken with autograd on (an evaluation loop runs under no_grad)


class SamplerPasses:
    """Which passes over a DistributedSampler were trained on, and which of them repeat an epoch.

    Passes are judged at step boundaries, not when they start: ``next(iter(loader))`` (a peek at a
    batch's size, before or after ``set_epoch``) starts a pass that no training step ever follows, so
    it is no epoch. At a boundary, the pass of each order (``key``) that yielded the latest index since
    the previous boundary is the one the step trained on, if it is still open (a validation loop runs its
    pass to the end between two steps) or gave the very last index before the step (an epoch that the
    DataLoader's workers drained in advance). A pass abandoned on purpose (``max_steps``) counts for
    the steps it fed. Bookkeeping is an integer per index; nothing touches a tensor.

    The order a DistributedSampler yields is a function of the dataset, its seed, its epoch and the
    rank's share: ``key`` holds those but the epoch, so a sampler built anew every epoch with the same
    seed and no ``set_epoch`` is seen repeating its order too.
    """

    def __init__(self) -> None:
        self.tick = 0  # one per index any watched sampler yielded
        self.judged = 0  # ``tick`` at the previous boundary
        self.live: list[Pass] = []
        self.trained: dict[tuple[Any, ...], dict[int, Pass]] = {}  # key -> epoch -> latest pass trained on
        self.pending: list[tuple[Pass, Pass]] = []  # (pass, earlier pass of its epoch): told or not at the next move

    def start(self, sampler: Any, where: str) -> Pass:
        key = (id(getattr(sampler, "dataset", None)), getattr(sampler, "total_size", None),
               getattr(sampler, "seed", None), getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None))
        p = Pass(key, int(getattr(sampler, "epoch", 0)), bool(getattr(sampler, "shuffle", False)), where)
        self.live = [*self.live[-(LIVE_PASSES - 1):], p]
        return p

    def counted(self, it: Iterator[int], p: Pass) -> Iterator[int]:
        """The sampler's indices as they are, each stamped with the clock."""
        grad_enabled = torch.is_grad_enabled
        for index in it:
            self.tick += 1
            p.tick = self.tick
            p.grad = p.grad or grad_enabled()
            yield index
        p.done = True

    def boundary(self, step: int) -> list[tuple[Pass, Pass]]:
        """A training step ended: the passes it trained on are marked. Returns (pass, earlier pass) for each
        pass now known to repeat the epoch of an earlier pass with the same order.

        A repeat is known one boundary later, when the same order moves again: if the earlier pass
        yielded after the new one by then, the new one was a look taken inside the earlier one's loop
        (``next(iter(loader))`` mid-epoch), not a new epoch."""
        since, self.judged = self.judged, self.tick
        moved = [p for p in self.live if p.tick > since]
        if not moved:
            return []
        keys = {p.key for p in moved}
        known, waiting = [], []
        for p, before in self.pending:
            if p.key not in keys:
                waiting.append((p, before))
            elif before.tick < p.tick:
                known.append((p, before))
            else:  # a look inside the earlier pass's loop: that pass is still the epoch's
                p.step = None
                self.trained.setdefault(p.key, {})[p.epoch] = before
        self.pending = waiting
        last = max(moved, key=lambda p: p.tick)
        newest: dict[tuple[Any, ...], Pass] = {}
        for p in moved:
            if p.key not in newest or p.tick > newest[p.key].tick:
                newest[p.key] = p
        for p in newest.values():
            # Not trained on: a pass run whole before this step that another pass followed, and a pass whose
            # every index was taken under no_grad / inference_mode (an evaluation loop: its loader is
            # iterated inside the no_grad block, also when it is the only sampler that moved).
            if p.step is not None or (p.done and p is not last) or not p.grad:
                continue
            p.step = step
            epochs = self.trained.setdefault(p.key, {})
            earlier = epochs.pop(p.epoch, None)
            epochs[p.epoch] = p
            # Bounded whatever the loop does (set_epoch(step) every step; samplers built anew): the latest
            # epochs of the latest orders.
            while len(epochs) > MAX_EPOCHS:
                del epochs[next(iter(epochs))]
            while len(self.trained) > MAX_ORDERS:
                del self.trained[next(iter(self.trained))]
            if earlier is not None:
                self.pending = [*self.pending[-(MAX_ORDERS - 1):], (p, earlier)]
        # let go of what can no longer be trained on: finished passes, and looks that no step followed
        self.live = [p for p in self.live if not p.done and (p.step is not None or p.tick > since)]
        return known

    def end(self) -> list[tuple[Pass, Pass]]:
        """At the script's end: the repeats still waiting for their order to move again."""
        known = [(p, before) for p, before in self.pending if before.tick < p.tick]
        self.pending = []
        return known


def identical_batches(per_rank: dict[int, Any]) -> tuple[list[int], list[int]]:
    """(steps every rank fingerprinted, those where all ranks held the same batch)."""
    by_step: dict[int, dict[int, Any]] = {}
    for rank, records in per_rank.items():
        for step, digest, _ in records:
            by_step.setdefault(step, {})[rank] = digest
    full = sorted(s for s, d in by_step.items() if len(d) == len(per_rank))
    same = [s for s in full if len(set(by_step[s].values())) == 1]
    return full, same


class DataOrder(ExchangeUser, Detector):
    name = "data_order"
    needs_model = True
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    def __init__(self) -> None:
        self.ctx: RankContext | None = None
        self.exchange: Any = None
        self.records: list[tuple[Any, ...]] = []  # (step, batch fingerprint, loss)
        self.pending: Any = None  # this step's batch fingerprint
        self._pending_id: int | None = None
        self.backward_seen = False  # the step's first backward ran: its batch is the last one fingerprinted
        self.history: dict[int, deque[tuple[Any, ...]]] = {}
        self.groups: dict[int, Any] = {}  # rank -> its data-parallel group (runtime.layout): who must differ
        self.reported: set[str] = set()
        self.passes = SamplerPasses()

    def setup(self, ctx: RankContext) -> None:
        self.ctx = ctx
        from torch.utils.data.distributed import DistributedSampler

        det = self

        def make(original: Any) -> Any:
            def __iter__(sampler: Any) -> Any:
                it = original(sampler)
                passes = det.passes
                try:
                    # the loop's line, under the DataLoader, a fault's wrapper, our patch
                    p = passes.start(sampler, user_line() or "?")
                except Exception as e:  # never break the user's data loading: switched off, said, pass unwatched
                    det.fail(e, "DistributedSampler.__iter__")
                    return it
                return passes.counted(it, p)
            return __iter__

        self.patch(ctx, DistributedSampler, "__iter__", make)

    def handover(self, successor: Detector) -> None:
        # The data goes on across a training phase: the passes already trained on, and what was told.
        if isinstance(successor, DataOrder):
            successor.passes = self.passes
            successor.reported |= self.reported & {"set_epoch"}

    def _set_epoch_findings(self, repeats: list[tuple[Pass, Pass]]) -> list[Finding]:
        ctx, out = self.ctx, []
        for p, before in repeats:
            if not p.shuffle or "set_epoch" in self.reported or ctx is None:
                continue  # shuffle=False: the same order every epoch is what was asked for
            self.reported.add("set_epoch")
            out.append(Finding(
                severity=Severity.WARNING, detector=self.name, ranks=[ctx.rank], step=p.step,
                subject="DistributedSampler.set_epoch",
                message=f"DistributedSampler(shuffle=True): the pass iterated at {p.where} and trained on from step "
                        f"{p.step} has epoch {p.epoch}, as the one trained on from step {before.step} had"
                        f"{'' if before.where == p.where else f' (iterated at {before.where})'}: set_epoch was not "
                        "called between them, so this epoch repeats that one's order",
                evidence={"epoch": p.epoch, "where": p.where, "step": p.step,
                          "earlier_where": before.where, "earlier_step": before.step},
                fix="call sampler.set_epoch(epoch) at the start of every epoch, before iterating the DataLoader",
            ))
        return out

    def attach(self, ctx: RankContext) -> None:

        from distdebug.runtime.discovery import unwrap

        self.ctx = ctx
        for root in ctx.models:
            self.hook(root, "forward_pre", self._pre_hook, with_kwargs=True)
            inner = unwrap(root)[0]
            if inner is not root:
                self.hook(inner, "forward_pre", self._pre_hook, with_kwargs=True)
        if ctx.models:
            self.open_exchange(ctx)

    def _pre_hook(self, module: Any, args: Any, kwargs: Any) -> None:
        # The step's batch is the input of its last forward before its first backward: the one whose
        # output reached the training backward. An evaluation forward between steps (a shared test batch,
        # the same on every rank) comes before it and is replaced; one under no_grad or eval() is not
        # even fingerprinted.
        if self.backward_seen or self.exchange is None:
            return
        if not torch.is_grad_enabled() or not getattr(module, "training", True):
            return
        t = first_tensor((args, kwargs))
        if t is None or id(t) == self._pending_id:
            return  # the wrapper's and the inner module's hooks see the same input
        # A CPU batch is hashed at once; a device batch is fingerprinted on the device and its 16 bytes
        # read with the step's other values at the boundary (probe). Only dtype and shape are kept of
        # the batch: nothing of the user's data outlives the forward.
        self.pending = PendingFingerprints([("batch", t)])
        self._pending_id = id(t)

    def after_backward(self) -> None:
        self.backward_seen = True

    def probe(self, step: int) -> dict[str, Any] | None:
        if self.pending is None:
            return None
        return rows_to_read([self.pending])

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        if self.ctx is not None:
            for f in self._set_epoch_findings(self.passes.boundary(event.step)):
                self.ctx.report(f)
        pending, self.pending = self.pending, None
        self.backward_seen, self._pending_id = False, None
        if self.exchange is None:
            return ()
        if pending is not None:
            fps = finish_read([pending], self.values(event))
            if fps is not None:
                self.records.append((event.step, fps["batch"], event.loss))  # a tuple: not the collector's to walk
        if not checked(event.step):
            return ()
        layout = self.ctx.layout if self.ctx is not None else None
        mine = {"records": self.records, "group": layout.data_group() if layout is not None else None}
        self.records = []

        def verdicts(gathered: list[Any]) -> None:  # on the exchange's thread
            ctx = self.ctx
            assert ctx is not None  # set in setup()/attach(), which the session calls first
            for rank, got in enumerate(gathered):
                got = got or {}
                self.history.setdefault(rank, deque(maxlen=HISTORY)).extend(got.get("records") or [])
                self.groups[rank] = got.get("group")
            if ctx.rank == 0:
                for f in self._verdicts():
                    ctx.report(f)

        self.exchange.post(mine, verdicts)
        return ()

    def _verdicts(self) -> list[Finding]:
        out: list[Finding] = []
        # TP, pipeline and context-parallel peers share a batch by design: compared within data-parallel
        # groups only (runtime.layout)
        for ranks in partition({r: self.groups.get(r) for r in self.history}):
            out += self._verdicts_among(ranks)
        return out

    def _verdicts_among(self, ranks: list[int]) -> list[Finding]:
        out: list[Finding] = []
        history = {r: self.history[r] for r in ranks}
        full, same = identical_batches(history)
        whole = len(ranks) == len(self.history)
        among = "every rank" if whole else f"every rank of data-parallel group {ranks}"
        if len(full) >= MIN_STEPS and same == full and "identical" not in self.reported:
            self.reported.add("identical")
            out.append(Finding(
                severity=Severity.WARNING, detector=self.name, ranks=ranks, step=full[0], subject="input batches",
                message=f"{among} trained on the same batch in each of steps {full[:8]}"
                        f"{' ...' if len(full) > 8 else ''}: the data is not sharded across ranks "
                        "(DistributedSampler missing?), so each rank repeats the others' work",
                evidence={"steps": full[:50], "ranks": ranks},
                fix="DataLoader(dataset, sampler=DistributedSampler(dataset), ...) and sampler.set_epoch(epoch) "
                    "every epoch; if every rank is meant to see the same data, ignore this",
            ))
        losses: dict[int, dict[int, float]] = {}
        for rank, records in history.items():
            for s, _, loss in records:
                if s in same and loss is not None:
                    losses.setdefault(s, {})[rank] = loss
        for s in sorted(losses):
            values = losses[s]
            if len(values) < len(ranks) or "loss_mismatch" in self.reported:
                continue
            lo, hi = min(values.values()), max(values.values())
            if not (math.isfinite(lo) and math.isfinite(hi)):
                continue
            if hi - lo > LOSS_RTOL * max(abs(lo), abs(hi), 1e-12):
                self.reported.add("loss_mismatch")
                out.append(Finding(
                    severity=Severity.ERROR, detector=self.name, ranks=ranks, step=s, subject="loss",
                    message=f"{among} had the same batch at step {s} but their losses differ: {values} "
                            f"(more than {LOSS_RTOL:g} apart): the replicas are not the same model (different "
                            "initialisation or seeds, an unsynchronised update) or the computation is not "
                            "deterministic",
                    evidence={"losses": values, "rtol": LOSS_RTOL},
                    fix="seed every rank alike and broadcast the initial parameters (DDP does at construction); "
                        "'distdebug diff RUN' shows which tensors differ",
                ))
        return out


    def on_end(self) -> Iterable[Finding]:
        self.close_exchange(clean=False)
        return self._set_epoch_findings(self.passes.end())

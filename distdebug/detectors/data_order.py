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
- ``DistributedSampler(shuffle=True)`` iterated again for a new epoch without ``set_epoch`` having
  changed its epoch repeats the previous order exactly: found from the sampler itself (its
  ``__iter__`` is watched from the script's first line), with the file and line of the loop.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Iterable
from typing import Any

import torch

from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.fingerprint.hashing import PendingFingerprints, finish_read, rows_to_read
from distdebug.runtime.discovery import first_tensor
from distdebug.runtime.exchange import ExchangeUser
from distdebug.runtime.exchange import checked_step as checked
from distdebug.runtime.layout import partition

MIN_STEPS = 3
LOSS_RTOL = 1e-5



def identical_batches(per_rank: dict[int, list[list[Any]]]) -> tuple[list[int], list[int]]:
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
    description = ("ranks training on identical batches (DistributedSampler missing), DistributedSampler "
                   "without set_epoch, the same batch giving different losses")

    def __init__(self) -> None:
        self.ctx: RankContext | None = None
        self.exchange: Any = None
        self.records: list[list[Any]] = []  # [step, batch fingerprint, loss]
        self.pending: Any = None  # this step's batch fingerprint
        self._pending_id: int | None = None
        self.backward_seen = False  # the step's first backward ran: its batch is the last one fingerprinted
        self.history: dict[int, list[list[Any]]] = {}
        self.groups: dict[int, Any] = {}  # rank -> its data-parallel group (runtime.layout): who must differ
        self.reported: set[str] = set()
        self._epochs: dict[int, int] = {}  # id(sampler) -> epoch of its last real pass
        self._passes: dict[int, tuple[int, list[int]]] = {}  # id(sampler) -> (epoch, [indices taken]) of its last pass
        self._hooks: list[Any] = []

    def setup(self, ctx: RankContext) -> None:
        self.ctx = ctx
        from torch.utils.data.distributed import DistributedSampler

        det = self

        def make(original: Any) -> Any:
            def __iter__(sampler: Any) -> Any:
                det._guard(det._sampler_iter, sampler)
                it = original(sampler)
                counter = det._passes.get(id(sampler))
                return det._counted(it, counter[1]) if counter is not None else it
            return __iter__

        self.patch(ctx, DistributedSampler, "__iter__", make)

    @staticmethod
    def _counted(it: Any, taken: list[int]) -> Any:
        """The sampler's indices as they are, counted: how much of a pass the loop really consumed."""
        for index in it:
            taken[0] += 1
            yield index

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # never break the user's data loading
            pass

    def _sampler_iter(self, sampler: Any) -> None:
        """A new pass over a DistributedSampler. A pass counts once the loop has consumed at least half
        of it: ``next(iter(loader))`` before the epoch loop (a peek at one batch) is not a pass, so the
        loop's own first pass, after set_epoch(0), does not 'repeat' it."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        key = id(sampler)
        epoch = int(getattr(sampler, "epoch", 0))
        last = self._passes.get(key)
        if last is not None and last[1][0] * 2 >= max(1, len(sampler)):
            self._epochs[key] = last[0]  # the previous pass was a real one
        self._passes[key] = (epoch, [0])
        before = self._epochs.get(key)
        if before is None or epoch != before or not getattr(sampler, "shuffle", False) or "set_epoch" in self.reported:
            return
        self.reported.add("set_epoch")
        frame = next((f for f in reversed(traceback.extract_stack()[:-3])
                      if "distdebug" not in f.filename and "/torch/" not in f.filename), None)
        where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" if frame else "?"
        ctx.report(Finding(
            severity=Severity.WARNING, detector=self.name, ranks=[ctx.rank], step=None,
            subject="DistributedSampler.set_epoch",
            message=f"DistributedSampler(shuffle=True) starts another pass over the data with epoch {epoch} again "
                    f"(iterated at {where}): set_epoch was not called, so every epoch repeats the same order",
            evidence={"epoch": epoch, "where": where},
            fix="call sampler.set_epoch(epoch) at the start of every epoch, before iterating the DataLoader",
        ))

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
        pending, self.pending = self.pending, None
        self.backward_seen, self._pending_id = False, None
        if self.exchange is None:
            return ()
        if pending is not None:
            fps = finish_read([pending], self.values(event))
            if fps is not None:
                self.records.append([event.step, fps["batch"], event.loss])
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
                self.history.setdefault(rank, []).extend(got.get("records") or [])
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
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return ()

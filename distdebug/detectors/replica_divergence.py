"""ReplicaDivergence: the first step, tensor and rank at which data-parallel replicas stop being identical.

Every K steps (``--fingerprint-every``, default 1), at the step boundary (after ``optimizer.step``,
before gradients are cleared), each rank fingerprints its replicated tensors (see
``fingerprint.collect``) on the training thread, because the next step changes them in place.
Everything else happens on a background thread, so the training never waits for it: the snapshot
write, and per checked step one 40-byte record (step, backward passes, root digest of the tensors all
ranks share, replica-group id and root digest of the tensors shared within an HSDP replicate group)
per rank, BATCH (32) steps to one all_gather on a gloo group of the harness's own, so the training's
collectives and their order are never touched. Only when root digests differ are the per-tensor
fingerprints exchanged, to name the tensors; with 3 or more ranks the odd ones out are found by
majority, with 2 ranks both are named.

Fully sharded parameters (FSDP2 full shard, ZeRO-3) are fingerprinted as the forward sees them,
gathered, by forward pre-hooks armed only in checked steps (see ``fingerprint.collect``).

Buffers under DDP with ``broadcast_buffers=True`` are fingerprinted at the start of the forward
(after DDP has synchronised them), because BatchNorm updates them rank-locally during forward:
at the step boundary they differ by design. Elsewhere they are fingerprinted at the boundary.

The finding is written once, at the first divergent step, by the lowest rank. If the ranks'
step counters disagree (a rank skipped ``optimizer.step``), that is reported and the check stops,
so that the harness's own collectives can never pair the wrong steps or wait at the end.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Iterable
from typing import Any

import torch
import xxhash

from distdebug import envvars
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.fingerprint.collect import ReplicaSet, model_layout
from distdebug.fingerprint.compare import compare, divergence_finding, odd_ones_out
from distdebug.fingerprint.hashing import fingerprints, root_digest
from distdebug.fingerprint.snapshots import SnapshotWriter
from distdebug.runtime.exchange import HARNESS_GROUP_DESC

QUEUE_STEPS = 256
"""Checks the background exchange may fall behind before it is stopped (never blocks training)."""
BATCH = 32
"""Checked steps per exchange: one all_gather carries BATCH records, so the harness's collectives
cost 1/BATCH of one per step. The first divergent step is still exact (each record carries its
step); the finding comes at most BATCH checks later, or at the end of the run."""
DRAIN_TIMEOUT_S = 10.0
_FIELDS = 5  # step, backward passes, root digest of world replicas, replica-group id, its root digest


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


class ReplicaDivergence(Detector):
    name = "replica_divergence"
    description = "data-parallel replicas differ: first step, tensor names and odd rank(s) (cross-rank fingerprints)"

    def __init__(self) -> None:
        self.every = max(1, int(envvars.get(envvars.FINGERPRINT_EVERY) or 1))
        self.ctx: RankContext | None = None
        self.group: Any = None
        self.snapshots: SnapshotWriter | None = None
        self.replicas: ReplicaSet | None = None
        self.synced_buffers: dict[str, int] | None = None
        self.forward_fps: dict[str, int] = {}
        self.armed = False  # the coming step is checked: forward hooks fingerprint
        self.reported = False
        self._hooks: list[Any] = []
        self._queue: queue.Queue | None = None
        self._batch: list[tuple[int, int, dict[str, int]]] = []
        self._thread: threading.Thread | None = None
        self._stopped = False

    def attach(self, ctx: RankContext) -> None:
        import torch.distributed as dist

        self.ctx = ctx
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.replicas = ReplicaSet(ctx.models, ctx.optimizers, world)
        if ctx.rank_dir is not None:
            self.snapshots = SnapshotWriter(ctx.rank_dir)
        if world > 1:
            # A group of our own: our all_gathers never interleave with the training's collectives.
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=300),
                                        group_desc=HARNESS_GROUP_DESC)
            self._queue = queue.Queue(maxsize=QUEUE_STEPS // BATCH)
            self._thread = threading.Thread(target=self._worker, name="distdebug-fingerprints", daemon=True)
            self._thread.start()
        for root in ctx.models:
            inner, _, ddp_sync = model_layout(root)
            if ddp_sync:
                self._hooks.append(inner.register_forward_pre_hook(self._capture_synced_buffers))
        for prefix, module, names in self.replicas.forward_modules:
            # Registered after the framework's unshard/gather hook, so it sees gathered parameters.
            self._hooks.append(module.register_forward_pre_hook(self._forward_hook(prefix, names)))
        self.armed = False  # on_step arms the checked steps

    def _forward_hook(self, prefix: str, names: list[str]) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if self.armed and (prefix + names[0]) not in self.forward_fps:  # first forward of the step
                self.forward_fps.update(fingerprints(ReplicaSet.unsharded(prefix, module, names)))
        return hook

    def _capture_synced_buffers(self, module: torch.nn.Module, args: Any) -> None:
        if self.armed and self.synced_buffers is None and self.replicas is not None:
            # the first forward of the step, right after DDP's sync
            self.synced_buffers = fingerprints(self.replicas.buffers)

    def _local(self) -> dict[str, int]:
        assert self.replicas is not None
        fps = fingerprints(self.replicas.tensors())
        fps.update(self.forward_fps)
        if self.replicas.ddp_sync:
            fps.update(self.synced_buffers or {})
        else:
            fps.update(fingerprints(self.replicas.buffers))
        return fps

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        if self.ctx is None or event.step % self.every:
            self._next(event.step)
            return ()
        fps = self._local()
        self._next(event.step)
        if self.snapshots is not None:
            # Written here, one append per check: a rank killed a moment later keeps every snapshot.
            self.snapshots.write(event.step, fps)
        if self._queue is None or self._stopped:
            return ()
        self._batch.append((event.step, event.backward_total, fps))
        if len(self._batch) < BATCH:
            return ()
        batch, self._batch = self._batch, []
        try:
            self._queue.put_nowait((batch, True))  # one hand-over to the background thread per BATCH checks
        except queue.Full:
            # The exchange is stuck (a peer is gone): stop here rather than ever block training.
            self._stopped = True
            return (Finding(
                severity=Severity.WARNING, detector=self.name, ranks=[self.ctx.rank], step=event.step,
                subject="cross-rank check", message=f"the cross-rank exchange fell {QUEUE_STEPS} checks behind; "
                "stopped on this rank (snapshots go on)", evidence={},
            ),)
        return ()

    def _next(self, step: int) -> None:
        self.synced_buffers = None
        self.forward_fps = {}
        self.armed = (step + 1) % self.every == 0

    def _worker(self) -> None:
        """Background: the cross-rank exchange, in step order, BATCH checks at a time."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        assert self._queue is not None
        while True:
            item = self._queue.get()
            if item is None:
                return
            pending, exchange = item
            # A full batch, or the last (maybe empty) one when the script destroys its process
            # group: every rank makes the same number of exchanges.
            if exchange and self.group is not None:
                try:
                    for finding in self._exchange(pending):
                        ctx.report(finding)
                except Exception as e:  # a peer that left, a destroyed group: stop checking, never raise
                    self.group = None
                    ctx.report(Finding(  # info: it follows from a failure that other findings explain
                        severity=Severity.INFO, detector="harness", ranks=[ctx.rank],
                        step=pending[0][0] if pending else None, subject=f"detector:{self.name}",
                        message=f"cross-rank exchange failed ({type(e).__name__}: {str(e)[:200]}); "
                                "stopped on this rank", evidence={},
                    ))

    def _row(self, step: int, backward_total: int, fps: dict[str, int]) -> list[int]:
        world = {n: v for n, v in fps.items() if "@replicas[" not in n}
        grouped = {n: v for n, v in fps.items() if "@replicas[" in n}
        group_id = xxhash.xxh3_64_intdigest("|".join(sorted({n[n.index("@"):] for n in grouped})).encode())
        return [step, backward_total, _signed(root_digest(world)), _signed(group_id),
                _signed(root_digest(grouped)) if grouped else 0]

    def _exchange(self, batch: list[tuple[int, int, dict[str, int]]]) -> Iterable[Finding]:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        import torch.distributed as dist

        raw = ctx.raw_collectives
        world = dist.get_world_size(self.group)
        mine = torch.full((BATCH, _FIELDS), -1, dtype=torch.int64)
        for i, (step, backward_total, fps) in enumerate(batch):
            mine[i] = torch.tensor(self._row(step, backward_total, fps), dtype=torch.int64)
        gathered = [torch.zeros(BATCH, _FIELDS, dtype=torch.int64) for _ in range(world)]
        raw["all_gather"](gathered, mine, group=self.group)
        rows = [t.tolist() for t in gathered]
        for i in range(BATCH):
            steps = {r: rows[r][i][0] for r in range(world)}
            if all(v == -1 for v in steps.values()):
                break
            backwards = {r: rows[r][i][1] for r in range(world)}
            if len(set(steps.values())) > 1 or len(set(backwards.values())) > 1:
                # A rank skipped (or repeated) optimizer.step: its step boundaries no longer line up with
                # the others'. Every rank saw the same records, so all stop checking together, and the
                # harness's own collectives can never pair the wrong steps or wait at the end.
                self.group = None
                behind, _ = odd_ones_out(backwards if len(set(steps.values())) == 1 else steps)
                step = min(v for v in steps.values() if v >= 0)
                return self._emit(Finding(
                    severity=Severity.ERROR, detector=self.name, ranks=behind, step=step,
                    subject="optimizer step count",
                    message=f"optimizer steps and backward passes no longer line up across ranks (step: {steps}, "
                            f"backward passes so far: {backwards}): rank(s) {behind} skipped or repeated "
                            "optimizer.step, so their parameters are no longer updated in step with the others",
                    evidence={"steps": steps, "backward_total": backwards},
                    fix="every rank must call optimizer.step() once per step (look for rank-dependent conditions "
                        "around it)",
                ))
            if self.reported:
                continue
            world_roots = {rows[r][i][2] for r in range(world)}
            by_group: dict[int, set[int]] = {}
            for r in range(world):
                by_group.setdefault(rows[r][i][3], set()).add(rows[r][i][4])
            if len(world_roots) == 1 and all(len(v) == 1 for v in by_group.values()):
                continue
            self.reported = True
            step, _, fps = batch[i]
            return self._name_tensors(step, fps, world)
        return ()

    def _name_tensors(self, step: int, fps: dict[str, int], world: int) -> Iterable[Finding]:
        """Roots differ at ``step``: exchange per-tensor fingerprints (this once) to name the tensors."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        per_rank: list[Any] = [None] * world
        ctx.raw_collectives["all_gather_object"](per_rank, fps, group=self.group)
        diffs = compare(dict(enumerate(per_rank)), list(fps))
        if not diffs:
            return ()
        run_dir = str(ctx.run_dir) if ctx.run_dir is not None else None
        return self._emit(divergence_finding(step, diffs, world, run_dir=run_dir))

    def _emit(self, finding: Finding) -> Iterable[Finding]:
        # Every rank reaches the same verdict; one writes it.
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        return (finding,) if ctx.rank == 0 else ()

    def before_destroy(self) -> None:
        """The script destroys its process group (every rank does, at a clean end): the last exchange."""
        self._finish(final_exchange=True)

    def _finish(self, final_exchange: bool) -> None:
        """Finish the queued checks, then release the harness group (before the script destroys its own).

        The last, partial batch is exchanged only when the script destroys its process group, which
        every rank does together. A rank that ends otherwise (an exception, an early exit, the end
        of a script that never destroys its group) cannot know whether its peers will ever exchange
        those steps, so it does not wait: their snapshots are on disk, and the launcher's check
        after the job (``analysis.diff``) covers them.
        """
        import torch.distributed as dist

        if self._thread is not None:
            assert self._queue is not None
            batch, self._batch = self._batch, []
            if not self._stopped and final_exchange:
                self._queue.put((batch, True))
            self._queue.put(None)
            self._thread.join(timeout=DRAIN_TIMEOUT_S)
            self._thread = None
        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            dist.distributed_c10d.destroy_process_group(group)

    def on_end(self) -> Iterable[Finding]:
        self._finish(final_exchange=False)
        for h in self._hooks:
            h.remove()
        if self.snapshots is not None:
            self.snapshots.close()
            self.snapshots = None
        return ()

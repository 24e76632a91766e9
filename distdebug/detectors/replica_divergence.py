"""ReplicaDivergence: the first step, tensor and rank at which data-parallel replicas stop being identical.

Every K steps (``--fingerprint-every``, default 1), at the step boundary (after ``optimizer.step``,
before gradients are cleared), each rank fingerprints its replicated tensors (see
``fingerprint.collect``) on the training thread, because the next step changes them in place.
Everything else happens on a background thread, so the training never waits for it: the snapshot
write, and one 24-byte record (step, backward passes, root digest) per rank in an all_gather on a
gloo group of the harness's own, so the training's collectives and their order are never touched.
Only when root digests differ are the per-tensor
fingerprints exchanged, to name the tensors; with 3 or more ranks the odd ones out are found by
majority, with 2 ranks both are named.

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

from distdebug import envvars
from distdebug.detectors.base import Detector, Finding, Severity, StepEvent
from distdebug.fingerprint.collect import model_layout, replicated_buffers, replicated_params
from distdebug.fingerprint.compare import compare, odd_ones_out
from distdebug.fingerprint.hashing import fingerprints, root_digest
from distdebug.fingerprint.snapshots import SnapshotWriter

MAX_NAMED = 10
QUEUE_STEPS = 256
"""Checks the background exchange may fall behind before it is stopped (never blocks training)."""
DRAIN_TIMEOUT_S = 10.0
HARNESS_GROUP_DESC = "distdebug_harness"
"""Description of the harness's own process group; hang analysis leaves its collectives out."""


class ReplicaDivergence(Detector):
    name = "replica_divergence"
    description = "data-parallel replicas differ: first step, tensor names and odd rank(s) (cross-rank fingerprints)"

    def __init__(self) -> None:
        self.every = max(1, int(envvars.get(envvars.FINGERPRINT_EVERY) or 1))
        self.ctx: Any = None
        self.group: Any = None
        self.snapshots: SnapshotWriter | None = None
        self.synced_buffers: dict[str, int] | None = None
        self.reported = False
        self._hooks: list[Any] = []
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    def attach(self, ctx: Any) -> None:
        import torch.distributed as dist

        self.ctx = ctx
        if ctx.rank_dir is not None:
            self.snapshots = SnapshotWriter(ctx.rank_dir)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # A group of our own: our all_gathers never interleave with the training's collectives.
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=300),
                                        group_desc=HARNESS_GROUP_DESC)
            self._queue = queue.Queue(maxsize=QUEUE_STEPS)
            self._thread = threading.Thread(target=self._worker, name="distdebug-fingerprints", daemon=True)
            self._thread.start()
        for root in ctx.models:
            inner, _, ddp_sync = model_layout(root)
            if ddp_sync:
                self._hooks.append(inner.register_forward_pre_hook(self._capture_synced_buffers))

    def _capture_synced_buffers(self, module: torch.nn.Module, args: Any) -> None:
        if self.synced_buffers is None:  # the first forward of the step, right after DDP's sync
            self.synced_buffers = fingerprints(replicated_buffers(self.ctx.models))

    def _local(self) -> dict[str, int]:
        models, opts = self.ctx.models, self.ctx.optimizers
        fps = fingerprints(replicated_params(models, opts))
        ddp_sync = any(model_layout(m)[2] for m in models)
        if ddp_sync:
            fps.update(self.synced_buffers or {})
        else:
            fps.update(fingerprints(replicated_buffers(models)))
        return fps

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        if self.ctx is None or event.step % self.every:
            self.synced_buffers = None
            return ()
        fps = self._local()
        self.synced_buffers = None
        if self._queue is None or self._stopped:
            if self.snapshots is not None:
                self.snapshots.write(event.step, fps)
            return ()
        try:
            self._queue.put_nowait((event.step, event.backward_total, fps))
        except queue.Full:
            # The exchange is stuck (a peer is gone): stop here rather than ever block training.
            self._stopped = True
            return (Finding(
                severity=Severity.WARNING, detector=self.name, ranks=[self.ctx.rank], step=event.step,
                subject="cross-rank check", message=f"the cross-rank exchange fell {QUEUE_STEPS} checks behind; "
                "stopped on this rank (snapshots go on)", evidence={},
            ),)
        return ()

    def _worker(self) -> None:
        """Background: snapshot writes and the cross-rank exchange, in step order."""
        assert self._queue is not None
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, backward_total, fps = item
            if self.snapshots is not None:
                self.snapshots.write(step, fps)
            if self.group is None:
                continue
            try:
                for finding in self._exchange(step, backward_total, fps):
                    self.ctx.report(finding)
            except Exception as e:  # a peer that left, a destroyed group: stop checking, never raise
                self.group = None
                self.ctx.report(Finding(  # info: it follows from a failure that other findings explain
                    severity=Severity.INFO, detector="harness", ranks=[self.ctx.rank], step=step,
                    subject=f"detector:{self.name}",
                    message=f"cross-rank exchange failed ({type(e).__name__}: {str(e)[:200]}); stopped on this rank",
                    evidence={},
                ))

    def _exchange(self, step: int, backward_total: int, fps: dict[str, int]) -> Iterable[Finding]:
        import torch.distributed as dist

        raw = self.ctx.raw_collectives
        world = dist.get_world_size(self.group)
        digest = root_digest(fps)
        signed = digest - (1 << 64) if digest >= 1 << 63 else digest
        mine = torch.tensor([step, backward_total, signed], dtype=torch.int64)
        gathered = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
        raw["all_gather"](gathered, mine, group=self.group)
        steps = {r: int(t[0]) for r, t in enumerate(gathered)}
        backwards = {r: int(t[1]) for r, t in enumerate(gathered)}
        if len(set(steps.values())) > 1 or len(set(backwards.values())) > 1:
            # A rank skipped (or repeated) optimizer.step: its step boundaries no longer line up with
            # the others'. Every rank saw the same records, so all stop checking together, and the
            # harness's own collectives can never pair the wrong steps or wait at the end.
            self.group = None
            behind, _ = odd_ones_out(backwards if len(set(steps.values())) == 1 else steps)
            return self._emit(Finding(
                severity=Severity.ERROR, detector=self.name, ranks=behind, step=step,
                subject="optimizer step count",
                message=f"optimizer steps and backward passes no longer line up across ranks (step: {steps}, "
                        f"backward passes so far: {backwards}): rank(s) {behind} skipped or repeated optimizer.step, "
                        "so their parameters are no longer updated in step with the others",
                evidence={"steps": steps, "backward_total": backwards},
                fix="every rank must call optimizer.step() once per step (look for rank-dependent conditions "
                    "around it)",
            ))
        if len({int(t[2]) for t in gathered}) == 1 or self.reported:
            return ()
        self.reported = True
        per_rank: list[Any] = [None] * world
        raw["all_gather_object"](per_rank, fps, group=self.group)
        diffs = compare(dict(enumerate(per_rank)), list(fps))
        if not diffs:
            return ()
        culprits = sorted({r for d in diffs for r in d["ranks"]})
        named = ", ".join(d["tensor"] for d in diffs[:MAX_NAMED]) + (" ..." if len(diffs) > MAX_NAMED else "")
        majority = all(d["by_majority"] for d in diffs) and world >= 3
        who = (f"rank(s) {culprits} differ from the majority" if majority
               else f"ranks {culprits} disagree (no majority with {world} ranks)")
        return self._emit(Finding(
            severity=Severity.ERROR, detector=self.name, ranks=culprits, step=step,
            subject=diffs[0]["tensor"],
            message=f"replicas diverged at step {step}: {len(diffs)} tensor(s) differ ({named}); {who}",
            evidence={"tensors": diffs[:200], "count": len(diffs)},
            fix="first divergent step and tensor are above; 'distdebug diff RUN --step N' lists all of them. "
                "Usual causes: a rank-local update (unsynchronised gradients or buffers), silent data corruption, "
                "non-deterministic kernels",
        ))

    def _emit(self, finding: Finding) -> Iterable[Finding]:
        # Every rank reaches the same verdict; one writes it.
        return (finding,) if self.ctx.rank == 0 else ()

    def before_destroy(self) -> None:
        """Finish the queued checks, then release the harness group (before the script destroys its own)."""
        import torch.distributed as dist

        if self._thread is not None:
            assert self._queue is not None
            self._queue.put(None)
            self._thread.join(timeout=DRAIN_TIMEOUT_S)
            self._thread = None
        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            dist.distributed_c10d.destroy_process_group(group)

    def on_end(self) -> Iterable[Finding]:
        self.before_destroy()
        for h in self._hooks:
            h.remove()
        if self.snapshots is not None:
            self.snapshots.close()
            self.snapshots = None
        return ()

"""ReplicaDivergence: the first step, tensor and rank at which data-parallel replicas stop being identical.

Every K steps (``--fingerprint-every``, default 1), at the step boundary (after ``optimizer.step``,
before gradients are cleared), each rank fingerprints its replicated tensors (see
``detectors.replica_set``) on the training thread, because the next step changes them in place:
parameters and buffers at every check, gradients and optimizer state at the first 8 checks and every
8th after (``replica_divergence.state_every``): any divergence shows in the parameters at its step,
and the gradients, which say how it came, cost three times as much on an Adam model (issue 18). On
a device the fingerprints are computed there and read with the step's other values in its one
host read (``probe``; runtime.readout): 16 bytes per tensor.
Everything else happens on a background thread, so the training never waits for it: the snapshot
write, and per checked step one 40-byte record (step, backward passes, root digest of the tensors all
ranks share, replica-group id and root digest of the tensors shared within an HSDP replicate group)
per rank, BATCH (4) steps to one all_gather on a gloo group of the harness's own, so the training's
collectives and their order are never touched. Only when root digests differ are the per-tensor
fingerprints exchanged, to name the tensors; with 3 or more ranks the odd ones out are found by
majority, with 2 ranks both are named.

Fully sharded parameters (FSDP2 full shard, ZeRO-3) are fingerprinted as the forward sees them,
gathered, by forward pre-hooks armed only in checked steps (see ``detectors.replica_set``).

Buffers under DDP with ``broadcast_buffers=True`` are fingerprinted at the start of the forward
(after DDP has synchronised them), because BatchNorm updates them rank-locally during forward:
at the step boundary they differ by design. Elsewhere they are fingerprinted at the boundary.

The finding is written once, at the first divergent step, by the lowest rank. If the ranks'
step counters disagree (a rank skipped ``optimizer.step``), that is reported and the check stops,
so that the harness's own collectives can never pair the wrong steps or wait at the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import xxhash

from distdebug.artifacts import retention
from distdebug.artifacts.writer import os_error_text
from distdebug.cards.replica_divergence import CARD
from distdebug.config import ReplicaDivergenceConfig
from distdebug.context import ExchangeChannel, RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.detectors.replica_set import ReplicaSet, model_layout
from distdebug.findings import Finding, Severity
from distdebug.fingerprint.compare import compare, divergence_finding, odd_ones_out
from distdebug.fingerprint.hashing import root_digest
from distdebug.fingerprint.pending import PendingFingerprints, finish_read, rows_to_read
from distdebug.fingerprint.snapshots import SnapshotWriter
from distdebug.runtime.discovery import ddp_exists, find_ddp
from distdebug.runtime.exchange import CAPACITY, ExchangeUser
from distdebug.runtime.layout import Layout

BATCH = 4
"""Checked steps per exchange: one all_gather carries BATCH records, so the harness's collectives
cost 1/BATCH of one per step (on the exchange's own thread and group). The first divergent step is
still exact (each record carries its step); the finding comes at most BATCH checks later, during
the run (it was 32: a finding up to 32 steps late, or only after the job when the script never
destroys its process group)."""


_NO_GROUP = xxhash.xxh3_64_intdigest(b"")
"""The group id of a row with no replica group (the digest of no group names)."""


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


class ReplicaDivergence(ExchangeUser, Detector):
    name = "replica_divergence"
    needs_model = True
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    Config = ReplicaDivergenceConfig

    def __init__(self, config: ReplicaDivergenceConfig | None = None) -> None:
        self.config = config or ReplicaDivergenceConfig()
        self.every = self.config.every
        self.ctx: RankContext | None = None
        self.snapshots: SnapshotWriter | None = None
        self.replicas: ReplicaSet | None = None
        self.synced_buffers: PendingFingerprints | None = None
        self.forward_pending: list[PendingFingerprints] = []  # this step's fingerprints taken in forward
        self.forward_seen: set[str] = set()
        self._parts: list[PendingFingerprints] = []  # the checked step's fingerprints, read at the boundary
        self.armed = False  # the coming step is checked: forward hooks fingerprint
        self.reported = False
        self._grouped_in: dict[tuple[str, ...], bool] = {}  # a list of names -> whether any has a replica group
        self._batch: list[tuple[int, int, dict[str, int]]] = []
        self._stopped = False  # the ranks' step counts parted, or the exchange fell behind: no more checks

    def attach(self, ctx: RankContext) -> None:
        import torch.distributed as dist

        self.ctx = ctx
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.replicas = ReplicaSet(ctx.models, ctx.optimizers, ctx.layout or Layout(rank=ctx.rank, world=world))
        if ctx.rank_dir is not None:
            try:
                self.snapshots = SnapshotWriter(ctx.rank_dir, share=retention.rank_shares()[1])
                ctx.finding_listeners.append(self._pin)
            except OSError as e:  # a full or read-only run directory: no snapshots; the online check goes on
                self._snapshots_lost(1, os_error_text(e))
        if world > 1:
            # The rank's harness exchange: our all_gathers never interleave with the training's collectives.
            self.open_exchange(ctx)
        for root in ctx.models:
            inner, _, ddp_sync = model_layout(root)
            if ddp_sync and self.replicas.buffers:  # no buffers: nothing to take a forward
                self.hook(inner, "forward_pre", self._capture_synced_buffers)
        for prefix, module, names in self.replicas.forward_modules:
            # Registered after the framework's unshard/gather hook, so it sees gathered parameters.
            self.hook(module, "forward_pre", self._forward_hook(prefix, names))
        self.armed = False  # on_step arms the checked steps

    def _pin(self, finding: Finding) -> None:
        """Every finding of the rank keeps its neighbourhood's fingerprints whole (artifacts.retention)."""
        if self.snapshots is not None and isinstance(finding.step, int):
            self.snapshots.pins.add(finding.step)

    def _forward_hook(self, prefix: str, names: list[str]) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if self.armed and self.replicas is not None and prefix not in self.forward_seen:  # first forward
                self.forward_seen.add(prefix)
                # Launched now, while the parameters are gathered; read at the boundary with the rest.
                self.forward_pending.append(PendingFingerprints(self.replicas.unsharded(prefix, module, names)))
        return hook

    def _capture_synced_buffers(self, module: torch.nn.Module, args: Any) -> None:
        if self.armed and self.synced_buffers is None and self.replicas is not None:
            # the first forward of the step, right after DDP's sync
            self.synced_buffers = PendingFingerprints(self.replicas.buffers)

    def probe(self, step: int) -> dict[str, Any] | None:
        """At a checked step: this rank's fingerprints, as device rows for the step's one read."""
        self._parts = []
        if self.ctx is None or self.replicas is None or step % self.every:
            return None
        parts = [PendingFingerprints.of(*self.replicas.tensors(self.config.state_checked(step))),
                 *self.forward_pending]
        if self.replicas.buffers and not self.replicas.ddp_sync:  # a model without buffers: no part for them
            parts.append(PendingFingerprints(self.replicas.buffers))
        elif self.replicas.buffers and self.synced_buffers is not None:
            parts.append(self.synced_buffers)
        self._parts = parts
        return rows_to_read(parts)

    def _local(self, values: dict[str, Any]) -> dict[str, int] | None:
        return finish_read(self._parts, values)  # None: the step's read failed, no check this step

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        checked = self.ctx is not None and not event.step % self.every and bool(self._parts)
        fps = self._local(self.values(event)) if checked else None
        self._parts = []
        self._next(event.step)
        if fps is None or self.ctx is None:
            return ()
        if self.snapshots is not None:
            # Written here, one append per check: a rank killed a moment later keeps every snapshot.
            self.snapshots.write(event.step, fps)
            if self.snapshots.stopped is not None:
                self._snapshots_lost(*self.snapshots.stopped)
                self.snapshots = None
        if self.exchange is None or self._stopped:
            return ()
        self._batch.append((event.step, event.backward_total, fps))
        if len(self._batch) < BATCH:
            return ()
        if not self._post():
            # The exchange is stuck (a peer is gone): stopped here rather than ever block training.
            self._stopped = True
            return (Finding(
                severity=Severity.WARNING, detector=self.name, ranks=[self.ctx.rank], step=event.step,
                subject="cross-rank check", message=f"the cross-rank exchange fell {CAPACITY} exchanges behind; "
                "stopped on this rank (snapshots go on)", evidence={},
            ),)
        return ()

    def _post(self) -> bool:
        """One hand-over to the exchange per BATCH checks: the rows go, the fingerprints stay here."""
        batch, self._batch = self._batch, []
        channel = self.exchange  # the callback may run after close_exchange() (the drain at a clean end)
        if channel is None:
            return False
        return channel.post(batch, lambda rows: self._judge(channel, batch, rows), prepare=self._rows)

    def _snapshots_lost(self, step: int, why: str) -> None:
        """The run directory took no more fingerprints (a full or failing disk): said once; the online check
        goes on, and ``distdebug diff`` reads the steps written before it."""
        assert self.ctx is not None
        self.ctx.report(Finding(
            severity=Severity.WARNING, detector="harness", ranks=[self.ctx.rank], step=step,
            subject="fingerprint snapshots",
            message=f"fingerprint snapshots stopped at step {step} ({why}): the cross-rank check goes on; distdebug "
                    "diff reads only the steps before it",
            fix="free space in the run directory's file system, or give attach --run-dir on a larger one"))

    def _next(self, step: int) -> None:
        self.synced_buffers = None
        self.forward_pending = []
        self.forward_seen = set()
        self.armed = (step + 1) % self.every == 0

    def _row(self, step: int, backward_total: int, fps: dict[str, int]) -> list[int]:
        names = tuple(fps)
        grouped_in = self._grouped_in.get(names)
        if grouped_in is None:  # the same few name lists every step: which hold a replica group, found once
            if len(self._grouped_in) >= 8:
                self._grouped_in.clear()
            grouped_in = self._grouped_in[names] = any("@replicas[" in n for n in names)
        if not grouped_in:  # every tensor compared across the whole world (no copy of the map a tensor)
            return [step, backward_total, _signed(root_digest(fps)), _signed(_NO_GROUP), 0]
        world = {n: v for n, v in fps.items() if "@replicas[" not in n}
        grouped = {n: v for n, v in fps.items() if "@replicas[" in n}
        group_id = xxhash.xxh3_64_intdigest("|".join(sorted({n[n.index("@"):] for n in grouped})).encode())
        return [step, backward_total, _signed(root_digest(world)), _signed(group_id),
                _signed(root_digest(grouped)) if grouped else 0]

    def _rows(self, batch: list[tuple[int, int, dict[str, int]]]) -> list[list[int]]:
        return [self._row(step, backward_total, fps) for step, backward_total, fps in batch]

    def _judge(self, channel: ExchangeChannel, batch: list[tuple[int, int, dict[str, int]]],
               rows: list[Any]) -> None:
        """On the exchange thread, with every rank's rows of the same BATCH checks."""
        if self._stopped:
            return
        ctx = self.ctx
        assert ctx is not None  # set in attach(), which comes before any post
        for finding in self._verdict(channel, batch, rows):
            ctx.report(finding)

    def _verdict(self, channel: ExchangeChannel, batch: list[tuple[int, int, dict[str, int]]],
                 rows: list[Any]) -> Iterable[Finding]:
        world = len(rows)
        for i in range(max((len(r) for r in rows), default=0)):
            steps = {r: rows[r][i][0] if i < len(rows[r]) else -1 for r in range(world)}
            backwards = {r: rows[r][i][1] if i < len(rows[r]) else -1 for r in range(world)}
            if len(set(steps.values())) > 1 or len(set(backwards.values())) > 1:
                # A rank skipped (or repeated) optimizer.step: its step boundaries no longer line up with
                # the others'. Every rank saw the same records, so all stop checking together, and the
                # harness's own collectives can never pair the wrong steps or wait at the end.
                self._stopped = True
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
            return self._name_tensors(channel, step, fps, world)
        return ()

    def _name_tensors(self, channel: ExchangeChannel, step: int, fps: dict[str, int],
                      world: int) -> Iterable[Finding]:
        """Roots differ at ``step``: exchange per-tensor fingerprints (this once) to name the tensors."""
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        per_rank = channel.gather(fps)  # on the exchange thread, inside the callback: every rank does it
        diffs = compare(dict(enumerate(per_rank)), list(fps))
        if not diffs:
            return ()
        run_dir = str(ctx.run_dir) if ctx.run_dir is not None else None
        ddp = any(find_ddp(m) is not None for m in ctx.models) or ddp_exists()
        return self._emit(divergence_finding(step, diffs, world, run_dir=run_dir, ddp=ddp, compared=list(fps)))

    def _emit(self, finding: Finding) -> Iterable[Finding]:
        # Every rank reaches the same verdict; one writes it.
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        return (finding,) if ctx.rank == 0 else ()

    def before_destroy(self) -> None:
        """The script destroys its process group (every rank does, at a clean end): the last exchange.

        The last, partial batch is exchanged only then, when every rank does it together. A rank that
        ends otherwise (an exception, an early exit, the end of a script that never destroys its group)
        cannot know whether its peers will ever exchange those steps, so it does not wait: their
        snapshots are on disk, and the check after the job (``analysis.after_job``) covers them.
        """
        if self.exchange is not None and not self._stopped:
            self._post()
        self.close_exchange()

    def on_end(self) -> Iterable[Finding]:
        self.close_exchange()
        if self.snapshots is not None:
            self.snapshots.close()
            self.snapshots = None
        return ()

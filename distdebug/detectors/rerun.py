"""Rerun (opt-in: ``attach --rerun-on-anomaly``): re-execute a flagged step on the flagged rank, and say
whether what happened there is reproducible: a code path or the data (debug it) or a transient fault
of the machine (drain it).

Each step of each model is captured as it runs (``runtime.rerun``: inputs, generator states, the
parameters and buffers before the step, the gradients that reached the outputs, fingerprints of the
outputs and of the local gradients); the last ``keep`` steps are held. A rank is flagged at a step:

- on the rank itself, at that step's boundary: ``nan_origin`` (a non-finite value born on this rank)
  or ``loss_spike`` (this rank's own loss spiked);
- across ranks, through the harness's exchange (its background thread; a flag arrives a step or two
  later, while the step's capture is still held): this rank's parameters after the step differ from
  their replicas' (every parameter's fingerprint, every step: the majority of the replica group is
  right; with two replicas both are flagged), or its loss departs from the other ranks' (the rule of
  ``loss_spike``'s cross-rank check).

The flagged rank re-executes the step twice from its capture and compares with the first execution.
For parameters that differ from their replicas, it also re-reads them: the fingerprint of the
parameters as the next step read them (its capture) against the one exchanged at the step's end:
equal is a stored corruption (the value in memory is wrong and stays wrong: a bit flipped in
memory, or a write outside the step), different is a read error (two reads of an unchanged tensor
disagree). The verdict is a finding of its own, with the evidence and the action.

Cost: a copy of the parameters and buffers, and of each call's inputs and output gradients, for each
held step; a hook per parameter (a fingerprint of each local gradient); every parameter's
fingerprint at every step, exchanged. Off by default for that reason; ``bench/rerun_capture.py``
measures it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterable
from typing import Any

from distdebug.cards.rerun import CARD
from distdebug.config import RerunConfig
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.runtime.exchange import ExchangeUser

TRIGGERS = ("nan_origin", "loss_spike")
REPLICAS = "parameters differ from their replicas'"
DEPARTS = "loss departs from the other ranks'"


class Rerun(ExchangeUser, Detector):
    name = "rerun"
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds
    default = False
    needs_model = True
    Config = RerunConfig

    def __init__(self, config: RerunConfig | None = None) -> None:
        from distdebug.config import LossSpikeConfig
        from distdebug.detectors.loss_spike import CrossRank

        self.config = config or RerunConfig()
        self.ctx: RankContext | None = None
        self.recorders: list[Any] = []
        self.thread: threading.Thread | None = None
        self.done: set[int] = set()  # steps re-executed on this rank
        self.flags: list[tuple[int, str, dict[str, Any]]] = []  # (step, why, evidence), from any thread
        self.posted: dict[int, list[int]] = {}  # step -> this rank's parameter fingerprints exchanged for it
        self._pending: Any = None  # this boundary's fingerprints (fingerprint.pending.PendingFingerprints)
        self.parted = False  # the replicas differed at the last step judged (exchange thread)
        spike = LossSpikeConfig()
        self.cross = CrossRank(spike.threshold, spike.window)

    def attach(self, ctx: RankContext) -> None:
        from distdebug.runtime.discovery import is_deepspeed_engine, unwrap
        from distdebug.runtime.rerun import Recorder
        from distdebug.runtime.session import current_session

        self.ctx = ctx
        self.thread = threading.current_thread()  # the training thread: the boundary runs on it
        session = current_session()
        if session is None:  # no session, no steps: nothing to capture
            return
        for root in ctx.models:
            if is_deepspeed_engine(root):
                continue  # the engine owns the backward: not re-executed (docs/guides/nan-and-spikes.md)
            # The step in progress is the session's (its last boundary + 1); the collectives it counted tell
            # a forward that communicates.
            rec = Recorder(unwrap(root)[0], keep=self.config.keep, step_of=lambda: session.step + 1,
                           collectives=lambda: session.progress.collective_seq)
            if not rec.params or rec.sharded:
                continue  # sharded (FSDP2, DTensor): the forward gathers from peers; not captured (docs: NaN guide)
            inner = rec.module
            self.hook(inner, "forward_pre", rec.forward_pre, with_kwargs=True)
            self.hook(inner, "forward", rec.forward_post, with_kwargs=True)
            for i, p in enumerate(rec.params):
                handle = p.register_hook(self.guarded(rec.param_grad(i)))
                self.__dict__.setdefault("_guarded_handles", []).append(handle)
            ctx.end_of_backward.append(self.guarded(rec.backward_done))
            self.recorders.append(rec)
        ctx.finding_listeners.append(self._on_finding)
        if self.recorders:
            self.open_exchange(ctx)

    # ------------------------------------------------------------------ flags on this rank
    def _on_finding(self, f: Finding) -> None:
        """A finding this rank reports: a flag when it names this rank at a step (its own NaN or spike)."""
        if self.off or f.detector not in TRIGGERS or f.step is None or f.severity == Severity.INFO:
            return
        rank = self.ctx.identity.rank if self.ctx is not None else None
        if rank not in f.ranks or (f.evidence or {}).get("origin") == "another rank":
            return  # about another rank, or received from another rank: the origin rank re-executes
        if f.subject == "loss across ranks":
            return  # rank 0's view of another rank: that rank finds it in its own exchange (below)
        self.flags.append((f.step, f"{f.detector}: {f.subject}", {}))
        if threading.current_thread() is self.thread:
            self.guarded(self._handle_flags)()

    # ------------------------------------------------------------------ flags across ranks
    def probe(self, step: int) -> dict[str, Any] | None:
        """Every captured parameter's fingerprint after the step: CPU tensors hashed now, device tensors' sums
        launched here and read with the step's one host read."""
        if self.exchange is None:
            return None
        from distdebug.fingerprint.pending import PendingFingerprints, rows_to_read

        named = [(f"{k}.{n}", p.detach()) for k, rec in enumerate(self.recorders)
                 for n, p in zip(rec.param_names, rec.params, strict=True)]
        self._pending = PendingFingerprints(named)
        return rows_to_read([self._pending])

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        from distdebug.fingerprint.pending import finish_read

        pending, self._pending = self._pending, None
        fps = finish_read([pending], self.values(event)) if pending is not None else None
        rows = list(fps.values()) if fps is not None else None
        if self.exchange is not None and rows is not None:
            layout = self.ctx.layout if self.ctx is not None else None
            group = layout.data_group() if layout is not None else None
            self.posted[event.step] = rows
            for old in [s for s in self.posted if s < event.step - self.config.keep - 1]:
                del self.posted[old]
            self.last_step = event.step
            self.exchange.post({"step": event.step, "rows": rows, "loss": event.loss, "group": group}, self._judge)
        self._handle_flags()
        return ()

    def _judge(self, gathered: list[Any]) -> None:
        """On the exchange thread, with every rank's post of one step: which ranks are flagged (every rank
        judges the same data the same way; each keeps its own flags)."""
        ctx = self.ctx
        if ctx is None:
            return
        me = ctx.identity.rank
        posts = {r: p for r, p in enumerate(gathered) if isinstance(p, dict)}
        if me not in posts or len(posts) < 2:
            return
        step = posts[me]["step"]
        if any(p.get("step") != step for p in posts.values()):
            return  # the ranks' step counts parted: nothing to compare this time
        group = posts[me].get("group")
        if group is False:
            group = [me]
        peers = [r for r in posts if group is None or r in group]
        rows = {r: list(posts[r]["rows"]) for r in peers}
        if len({len(v) for v in rows.values()}) > 1:
            return  # not the same parameters (a layout this check does not know): nothing to compare
        counts: dict[Any, int] = {}
        for r in peers:
            key = tuple(rows[r])
            counts[key] = counts.get(key, 0) + 1
        parted = len(counts) > 1
        starts, self.parted = parted and not self.parted, parted
        if starts:  # the first step the replicas differ at: the steps after it inherit the difference
            best = max(counts.values())
            majority = [k for k, n in counts.items() if n == best]
            mine = tuple(rows[me])
            if len(majority) > 1 or mine not in majority:  # no majority (two replicas): every one is flagged
                ref = next(rows[r] for r in peers if r != me and tuple(rows[r]) != mine)
                first = next((i for i, (a, b) in enumerate(zip(mine, ref, strict=True)) if a != b), None)
                odd = sorted(r for r in peers if tuple(rows[r]) not in majority) if len(majority) == 1 else []
                self.flags.append((step, REPLICAS, {"tensor_index": first, "replicas": sorted(peers),
                                                    "majority": len(majority) == 1, "odd": odd}))
        losses = {r: posts[r].get("loss") for r in posts}
        for rank, *_ in self.cross.feed(step, losses):
            if rank == me:
                self.flags.append((step, DEPARTS, {}))

    # ------------------------------------------------------------------ re-execution
    def _handle_flags(self) -> None:
        """On the training thread: re-execute each flagged step still held (once per step)."""
        from distdebug.runtime import rerun
        from distdebug.runtime.session import current_session

        while self.flags:
            step, why, extra = self.flags.pop(0)
            if step in self.done or len(self.done) >= self.config.max_reruns:
                continue
            held = [(rec, rec.last(step)) for rec in self.recorders]
            held = [(rec, cap) for rec, cap in held if cap is not None]
            if not held:
                self.done.add(step)
                newest = max((c.step for rec in self.recorders for c in rec.ring), default=0)
                self._say_late(step, why, late=newest > step)
                continue
            self.done.add(step)
            session = current_session()
            around = (functools.partial(session.reexecution.replay, step) if session is not None
                      else contextlib.nullcontext)
            verdicts = [(rec, rerun.reexecute(rec, cap, around)) for rec, cap in held]
            for rec, v in verdicts:
                stored = self._reread(rec, step) if why == REPLICAS else None
                self._report(v, why, extra, stored, rec)

    def _reread(self, rec: Any, step: int) -> str | None:
        """The parameters as the next step read them (its capture) against those exchanged at ``step``'s end:
        'stored' (the same: the wrong value stays in memory) or 'read' (two reads of an unchanged tensor
        disagree); None when the next step's capture is not held."""
        from distdebug.fingerprint.pending import fingerprints

        nxt = rec.last(step + 1)
        posted = self.posted.get(step)
        if nxt is None or posted is None or len(self.recorders) != 1:
            return None
        now = fingerprints([(n, p) for n, p in zip(rec.param_names, nxt.params, strict=True)])  # the rare path
        return "stored" if list(now.values()) == list(posted) else "read"

    def _say_late(self, step: int, why: str, late: bool) -> None:
        assert self.ctx is not None
        rank = self.ctx.identity.rank
        reason = (f"the flag came after its capture was reused (captures of the last {self.config.keep} steps are "
                  "held: rerun.keep)" if late else
                  "no forward call of the model was captured in that step (a model's first step, before it is "
                  "discovered; a forward with gradients off; a compiled module: distdebug explain DD206)")
        self.ctx.report(Finding(
            severity=Severity.INFO, detector=self.name, ranks=[rank], step=step, subject=f"re-execution of step {step}",
            message=f"step {step} on rank {rank} ({why}) not re-executed: {reason}",
            evidence={"verdict": "late" if late else "not captured", "trigger": why}))

    def _report(self, v: Any, why: str, extra: dict[str, Any], stored: str | None, rec: Any) -> None:
        from distdebug.runtime import rerun

        assert self.ctx is not None
        rank = self.ctx.identity.rank
        host = self.ctx.identity.host
        index = extra.get("tensor_index")
        tensor = rec.param_names[index] if isinstance(index, int) and index < len(rec.param_names) else None
        evidence = {"verdict": v.kind, "trigger": why, "differs": v.differs, "reason": v.reason}
        if tensor:
            evidence["tensor"] = tensor
        fix: str | None
        if v.kind == rerun.REPRODUCIBLE and stored is not None:
            # The step computes the same again; the parameters differ from their replicas all the same.
            evidence["verdict"] = "stored corruption" if stored == "stored" else "read error"
            sev = Severity.ERROR
            which = ("" if extra.get("majority") else
                     f" (two replicas, {extra.get('replicas')}: which one holds the wrong value cannot be told; the "
                     "other says the same)")
            if stored == "stored":
                msg = (f"step {v.step} re-executed on rank {rank} ({why}" + (f", first {tensor}" if tensor else "")
                       + "): the step's computation reproduces bit for bit, and the parameters read the same again "
                       "at the next step: the stored value is wrong: a corruption in memory (a flipped bit) or a "
                       "write outside the step, not the step's arithmetic" + which)
                fix = (f"check rank {rank}'s memory ({host}: ECC error counters, nvidia-smi -q -d ECC / "
                       "dcgmi diag) and any code that writes parameters outside the optimizer; resume from the "
                       "last checkpoint (its replicas hold the right values)")
            else:
                msg = (f"step {v.step} on rank {rank} ({why}" + (f", first {tensor}" if tensor else "")
                       + "): the parameters read differently twice without an update in between: a read error "
                       "(suspect the machine)")
                fix = f"drain rank {rank}'s machine ({host}) and resume from the last checkpoint on another one"
        elif v.kind == rerun.NOT_REPRODUCIBLE:
            sev, msg = Severity.ERROR, (
                f"step {v.step} re-executed on rank {rank} ({why}): not reproducible: a transient fault: suspect "
                f"the machine. Re-executed twice from its inputs and parameters, it gives the same result both "
                f"times, and not the first execution's: {v.differs[0]} differs first"
                + (f" ({len(v.differs)} tensors in all)" if len(v.differs) > 1 else ""))
            fix = (f"drain rank {rank}'s machine ({host}) and resume from the last checkpoint on another one; "
                   f"run distdebug doctor there before it takes jobs again")
        elif v.kind == rerun.REPRODUCIBLE:
            sev, msg = Severity.WARNING, (
                f"step {v.step} re-executed on rank {rank} ({why}): reproducible: the same inputs and parameters "
                "give the same output and local gradients, bit for bit: a code path or the data, not the hardware")
            fix = (f"debug step {v.step}'s batch and code path on rank {rank}: it reproduces (the machine is not the "
                   "suspect)")
        else:
            sev, msg = Severity.INFO, f"step {v.step} on rank {rank} ({why}) not re-executed: {v.reason}"
            fix = None
        self.ctx.report(Finding(severity=sev, detector=self.name, ranks=[rank], step=v.step,
                                subject=f"re-execution of step {v.step}", message=msg, evidence=evidence, fix=fix))

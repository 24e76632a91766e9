"""Rerun (opt-in: ``attach --rerun-on-anomaly``): re-execute a flagged step on the flagged rank, and say
whether what happened there is reproducible: a code path or the data (debug it) or a transient fault
of the machine (drain it).

Each step of each model is captured as it runs (``runtime.rerun``: inputs, generator states, the
parameters and buffers before the step, the gradients that reached the outputs, fingerprints of the
outputs and of the local gradients). When this rank is flagged at the step just captured, on the
training thread, at that step's boundary (``nan_origin``: a non-finite value born on this rank;
``loss_spike``: this rank's own loss spiked), the step is re-executed twice from the capture and
compared with the first execution; the verdict is a finding of its own, with the evidence and the
action. Findings made later or elsewhere (a replica divergence, found by the cross-rank exchange
some steps after the fact) come after the capture has been reused: they are not re-executed, and the
README says so.

Cost: a copy of the parameters and buffers, and of each call's inputs and output gradients, every
step; a hook per parameter (a fingerprint of each local gradient). Off by default for that reason;
``bench/rerun_capture.py`` measures it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from distdebug.config import RerunConfig
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity

TRIGGERS = ("nan_origin", "loss_spike")


class Rerun(Detector):
    name = "rerun"
    description = "re-executes a flagged step from a capture: reproducible (code or data) or transient (the machine)"
    default = False
    needs_model = True
    Config = RerunConfig

    def __init__(self, config: RerunConfig | None = None) -> None:
        self.config = config or RerunConfig()
        self.ctx: RankContext | None = None
        self.recorders: list[Any] = []
        self.thread: threading.Thread | None = None
        self.done: set[int] = set()  # steps re-executed on this rank
        self.pending: list[Finding] = []

    def attach(self, ctx: RankContext) -> None:
        from distdebug.runtime.discovery import is_deepspeed_engine, unwrap
        from distdebug.runtime.rerun import Recorder

        self.ctx = ctx
        self.thread = threading.current_thread()  # the training thread: the boundary runs on it
        for root in ctx.models:
            if is_deepspeed_engine(root):
                continue  # the engine owns the backward: not re-executed (README)
            inner = unwrap(root)[0]
            if next(inner.parameters(), None) is None:
                continue
            rec = Recorder(inner)
            rec.step = self._session_step() + 1  # attached at a boundary: the next step is the first captured
            self.hook(inner, "forward_pre", rec.forward_pre, with_kwargs=True)
            self.hook(inner, "forward", rec.forward_post, with_kwargs=True)
            for i, p in enumerate(rec.params):
                handle = p.register_hook(self.guarded(rec.param_grad(i)))
                self.__dict__.setdefault("_guarded_handles", []).append(handle)
            ctx.end_of_backward.append(self.guarded(rec.backward_done))
            self.recorders.append(rec)
        ctx.finding_listeners.append(self._on_finding)

    @staticmethod
    def _session_step() -> int:
        from distdebug.runtime.session import current_session

        session = current_session()
        return session.step if session is not None else 1

    def _on_finding(self, f: Finding) -> None:
        """A finding of this rank: re-execute now if it flags this rank at the step just captured."""
        if self.off or threading.current_thread() is not self.thread or f.detector not in TRIGGERS:
            return
        rank = self.ctx.identity.rank if self.ctx is not None else None
        if rank not in f.ranks or f.step is None or f.step in self.done or f.severity == Severity.INFO:
            return
        if f.detector == "nan_origin" and (f.evidence or {}).get("origin") == "another rank":
            return  # received from another rank: the origin rank re-executes
        if len(self.done) >= self.config.max_reruns:
            return
        self.pending.append(f)
        self.guarded(self._rerun_pending)()

    def _rerun_pending(self) -> None:
        from distdebug.runtime import rerun

        while self.pending:
            f = self.pending.pop(0)
            if f.step in self.done or f.step is None:
                continue
            self.done.add(f.step)
            for rec in self.recorders:
                cap = rec.last(f.step)
                if cap is None:
                    continue
                from distdebug.runtime.session import current_session

                session = current_session()
                paused = Detector.paused
                Detector.paused = True  # every detector's hooks pass; injected faults (own class flag) act
                if session is not None:
                    session.replaying = True  # and the session's own module hooks
                try:
                    verdict = rerun.reexecute(rec, cap)
                finally:
                    Detector.paused = paused
                    if session is not None:
                        session.replaying = False
                self._report(verdict, f)

    def _report(self, v: Any, trigger: Finding) -> None:
        from distdebug.runtime import rerun

        assert self.ctx is not None
        rank = self.ctx.identity.rank
        what = f"{trigger.detector}: {trigger.subject}"
        evidence = {"verdict": v.kind, "trigger": what, "differs": v.differs, "reason": v.reason}
        host = self.ctx.identity.host
        if v.kind == rerun.NOT_REPRODUCIBLE:
            sev, msg = Severity.ERROR, (
                f"step {v.step} re-executed on rank {rank} ({what}): not reproducible: a transient fault: suspect "
                f"the machine. Re-executed twice from its inputs and parameters, it gives the same result both "
                f"times, and not the first execution's: {v.differs[0]} differs first"
                + (f" ({len(v.differs)} tensors in all)" if len(v.differs) > 1 else ""))
            fix = (f"drain rank {rank}'s machine ({host}) and resume from the last checkpoint on another one; "
                   f"run distdebug doctor there before it takes jobs again")
        elif v.kind == rerun.REPRODUCIBLE:
            sev, msg = Severity.WARNING, (
                f"step {v.step} re-executed on rank {rank} ({what}): reproducible: the same inputs and parameters "
                "give the same output and local gradients, bit for bit: a code path or the data, not the hardware")
            fix = (f"debug step {v.step}'s batch and code path on rank {rank}: it reproduces (the machine is not the "
                   "suspect)")
        else:
            sev, msg = Severity.INFO, f"step {v.step} on rank {rank} ({what}) not re-executed: {v.reason}"
            fix = None
        self.ctx.report(Finding(severity=sev, detector=self.name, ranks=[rank], step=v.step,
                                subject=f"re-execution of step {v.step}", message=msg, evidence=evidence, fix=fix))

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        for rec in self.recorders:
            rec.step = event.step + 1
        return ()

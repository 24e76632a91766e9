"""On-demand localisation: a healthy step pays only for a forward-only capture of its inputs (runtime.rerun);
the step found non-finite is re-executed from it on this rank alone with every module watched, and the
module hooks that full watch keeps on in every step are on only for that re-execution.

Why a mechanism of its own: it decides, per rank, between on-demand and full watch (what blocks the
re-execution: TP, pipelines, FSDP2, DeepSpeed, SyncBatchNorm, a compiled model, several models), turns full
when a captured forward communicates, and on the rare path re-runs the step or names parameters that were
written between two steps (the capture saw them non-finite, the previous boundary finite)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from distdebug.context import RankContext, StepEvent
from distdebug.detectors.nan_origin.core import NanOriginState
from distdebug.findings import Finding, Severity
from distdebug.runtime.discovery import unwrap


class Replay(NanOriginState):
    """The choice of watch and the on-demand re-execution (``_localise``) with its capture."""

    def _choose_watch(self, ctx: RankContext, blockers: list[str]) -> None:
        """On-demand watch where the step's forward can be re-executed on this rank alone, else full watch
        (config.watch, and the list of what re-execution cannot do in docs/guides/nan-and-spikes.md)."""
        layout = ctx.layout
        if getattr(layout, "sharded", None):
            blockers.append("tensor parallelism")
        if self.stage is not None:
            blockers.append("pipeline parallelism")
        if getattr(layout, "model_parallel_by_hand", None):
            blockers.append("collectives inside the forward")
        if self.sharded:
            blockers.append("sharded parameters")
        rec = None
        if self.config.watch == "on-demand" and not blockers:
            from distdebug.runtime.rerun import Recorder
            from distdebug.runtime.session import current_session

            session = current_session()
            if session is None or not ctx.models:
                blockers.append("no training session")
            else:
                # The step in progress is the session's last boundary + 1; the collectives it counts tell a
                # forward that communicates (then the watch turns full: _check_capture).
                rec = Recorder(unwrap(ctx.models[0])[0], keep=1, step_of=lambda: session.step + 1,
                               collectives=lambda: session.progress.collective_seq, forward_only=True)
                if rec.communicates:
                    blockers.append("SyncBatchNorm")
                elif not rec.params:
                    blockers.append("no trained parameters")
                if blockers:
                    rec = None
        self.watch_blockers = blockers
        if rec is None:
            self._watch_fully()
            return
        self.watch = "on-demand"
        self._recorder = rec
        self._capture_handles = [self.hook(rec.module, "forward_pre", rec.forward_pre, with_kwargs=True),
                                 self.hook(rec.module, "forward", rec.forward_post, with_kwargs=True)]

    def _watch_fully(self) -> None:
        """Every watched module's output checked in every step's forward from now on (full watch)."""
        self.watch = "full"
        self._recorder = None
        for h in self._capture_handles:
            if h is not None:
                h.remove()
        self._capture_handles = []
        for mod, kind, fn, kwargs in self._watch:
            self.hook(mod, kind, fn, **kwargs)

    def _check_capture(self) -> None:
        """A step whose forward communicated (a collective inside it): no step can be re-executed alone, so
        full watch from now on. Other reasons (too many calls in one step) concern that step only."""
        rec = self._recorder
        cap = rec.current if rec is not None else None
        if cap is not None and cap.communicates:
            self.watch_blockers = [cap.problem or "the forward communicates"]
            self._watch_fully()

    def _localise(self, step: int) -> tuple[list[tuple[str, torch.Tensor]], str]:
        """On-demand watch, the rare path: re-execute ``step``'s forward from its capture with every module
        watched (the hooks full watch keeps on every step), on this rank alone; every other hook of the
        harness passes meanwhile, injected faults act (Reexecution.replay_step: the step they see). Returns the
        module flags in forward order and '' or, when it could not run, [] and why."""
        rec = self._recorder
        cap = rec.last(step) if rec is not None else None
        if cap is None:
            return [], "the step's inputs were not held (its first forward came before the model was found)"
        if cap.problem:
            return [], cap.problem
        if not cap.calls:
            return [], "no forward call of the model with gradients on in the step"
        from distdebug.runtime.rerun import replay_forward
        from distdebug.runtime.session import current_session

        session = current_session()
        handles = []
        self.fwd.clear()
        try:
            for mod, kind, fn, kwargs in self._watch:  # not guarded by Detector.paused, which replay sets
                handles.append(getattr(mod, f"register_{kind}_hook")(_quiet(fn), **kwargs))
            with session.reexecution.replay(step) if session is not None else contextlib.nullcontext():
                replay_forward(rec, cap)
            return list(self.fwd.items()), ""
        except Exception as e:  # the model raised when run again: no module named, the rest stands
            return [], f"the re-execution raised {type(e).__name__}: {e}"
        finally:
            for h in handles:
                h.remove()
            self.fwd.clear()

    def _before(self, event: StepEvent) -> Finding | None:
        """On-demand watch: the parameters as this step's forward found them (its capture) were non-finite,
        while they were finite at the previous step's end (checked there): written between the steps, by
        something other than the optimizer's step (a checkpoint loaded, a manual edit, a memory fault).
        Named so; re-executing the forward would only show every module after them non-finite."""
        rec = self._recorder
        cap = rec.last(event.step) if rec is not None else None
        if cap is None or not getattr(self, "_previous_checked", True):
            return None  # the previous step unchecked (--measure-overhead's off step): its update may have done it
        bad = [n for n, t in zip(rec.param_names, cap.params, strict=True)  # the rare path: read here
               if t.numel() and not bool(t.isfinite().all())]
        if not bad:
            return None
        rank, step = event.rank, event.step
        return Finding(
            severity=Severity.ERROR, detector=self.name, ranks=[rank], step=step, subject=bad[0],
            message=f"NaN/Inf on rank {rank} at step {step}: parameters were non-finite when the step's forward began "
                    f"(first in the model's order: {bad[0]}; {len(bad)} in all) and finite at the end of step "
                    f"{step - 1}: written between the steps, not by the optimizer's step",
            evidence={"parameters_nonfinite_before_step": bad[:50], "origin": "this rank",
                      "loss": None if event.loss is None else str(event.loss)},
            fix="look for what writes the parameters between optimizer steps on this rank (a checkpoint loaded, "
                "an in-place edit of .data, a weight-tying or EMA update); a flipped bit in memory if nothing does")


def _quiet(fn: Any) -> Any:
    """A hook for the length of one re-execution: an exception of ours is swallowed (no module named)."""
    def hook(*args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            pass
    return hook

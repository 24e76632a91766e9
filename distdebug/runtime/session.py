"""Session: zero-code instrumentation of one rank's training loop.

How a step is seen without touching the script:
- the loss: ``torch.autograd.backward`` (what ``Tensor.backward`` calls) is wrapped to keep a
  detached reference to each scalar it runs on; a DeepSpeed engine's ``backward`` is wrapped
  instead when one is found, because ZeRO runs backward on the loss-scaled value;
- the step boundary: a global ``optimizer.step`` post-hook (every ``torch.optim`` optimizer),
  or a DeepSpeed engine's ``step`` at a gradient-accumulation boundary (ZeRO-3 may call its
  inner optimizer once per sub-group), or ``distdebug.step()`` when the script calls it;
- the models: during the first step only, global forward hooks note the outermost module of each
  forward (DDP, an FSDP2 root, a DeepSpeed engine, or a plain module); then they are removed, so
  later steps take ``nn.Module``'s fast path again;
- collectives: ``torch.distributed``'s Python collectives are wrapped to count calls per step and
  to tell hand-written gradient all-reduce from other traffic.

The session decides when (a step ends, a discovery ends, a phase changes) and runs the detectors; what
it keeps lives in rooms of its own, each behind a small interface: the wrappers in ``runtime.patches``,
the step in progress and its read in ``runtime.clock``, the models found in ``runtime.finder``, training
phases in ``runtime.phases``, re-execution's flags in ``runtime.reexecution``; what the rank is doing
(for the watchdog) in its progress record, ``runtime.progress``. Nothing here touches tensor values, RNG
state or the order of collectives: the harness observes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from distdebug.artifacts import schema
from distdebug.artifacts.writer import EventWriter
from distdebug.config import OVERHEAD_AUTO
from distdebug.context import RankContext, RankIdentity
from distdebug.envvars import MEASURE_OVERHEAD
from distdebug.envvars import get as env_get
from distdebug.findings import Finding, Severity
from distdebug.runtime import clock, cost, localgrads, overhead, stepsource, teardown
from distdebug.runtime.clock import StepClock
from distdebug.runtime.detector import Detector
from distdebug.runtime.dispatch import Dispatch
from distdebug.runtime.exchange import Exchange, checked_step, open_exchange
from distdebug.runtime.finder import Finder
from distdebug.runtime.outlet import Outlet
from distdebug.runtime.patches import TorchPatches
from distdebug.runtime.phases import Phases
from distdebug.runtime.progress import Progress
from distdebug.runtime.reexecution import Reexecution
from distdebug.runtime.stepsource import StepSource

_SESSION: Session | None = None

def current_session() -> Session | None:
    return _SESSION



class Session:
    """One per rank. ``install()`` before the script runs, ``close(exit_code)`` after."""

    def __init__(
        self,
        identity: RankIdentity,
        writer: EventWriter | None,
        detectors: list[Detector],
        run_dir: Path | None = None,
        rank_dir: Path | None = None,
        echo: bool = True,
    ) -> None:
        self.identity = identity
        self.ctx = RankContext(identity, run_dir, rank_dir)
        self.patches = TorchPatches(self)
        self.ctx.report = self.report
        self.ctx.patch = self.patches.patch
        self.ctx.raw_collectives = self.patches.raw_collectives
        self.ctx.communication_observers = self.patches.communication_observers  # one list, shared
        self.ctx.emit = lambda kind, **fields: self.emit(schema.record(kind, rank=identity.rank, time=time.time(),
                                                                        **fields))
        self.step = 0
        self.outlet = Outlet(self.ctx, writer, echo, lambda: self.step)
        """Records and findings out of the rank (runtime.outlet)."""
        self.ledger = cost.Ledger()
        """What the harness costs this rank (runtime.cost): hooks, boundary work, reads, threads."""
        self.dispatch = Dispatch(detectors, self.ledger, self.report, self.outlet.detector_failed)
        """The detectors, and each call into one, guarded and timed (runtime.dispatch)."""
        self.source = StepSource()
        """Which call ends a training step (runtime.stepsource)."""
        self.clock = StepClock()
        """The step in progress: its loss, counters and time, and the step's read (runtime.clock)."""
        self.reexecution = Reexecution()
        """Whether a step is being re-executed (runtime.reexecution)."""
        self.finder = Finder(self.reexecution, self.clock, self._found_engine)
        """The models found in a phase's first step (runtime.finder)."""
        self.phases = Phases()
        """What tells a new training phase, and the detectors' change-over (runtime.phases)."""
        self._handles: list[Any] = []
        block = int(env_get(MEASURE_OVERHEAD) or 0)
        if block == OVERHEAD_AUTO:
            block = overhead.default_unit(torch.cuda.is_available())
        self._ab = overhead.Pairs(block) if block else None  # attach --measure-overhead (runtime.overhead)
        self._ab_seen_regions = 0  # the ledger's one-off regions at the last boundary (a step that did work once)
        self.progress = Progress()
        """What the rank is doing, for the watchdog thread (runtime.progress)."""
        self.inflight: Any = None  # artifacts.inflight.InflightSlot when there is a run directory
        self._released_defaults: list[str] = []
        self._exchange: Exchange | None = None
        self._closed = False

    # ------------------------------------------------------------------ the rooms' public side
    @property
    def detectors(self) -> list[Detector]:
        """The detectors running on this rank (runtime.dispatch)."""
        return self.dispatch.detectors

    @detectors.setter
    def detectors(self, value: list[Detector]) -> None:
        self.dispatch.detectors = value
        self.dispatch.arrange()

    @property
    def roots(self) -> list[torch.nn.Module]:
        """The models found so far (outermost module of each forward), in the order first seen."""
        return self.finder.roots

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        global _SESSION
        _SESSION = self
        cost.LEDGER = self.ledger  # the wrappers' bookkeeping counts as the session's
        from torch.optim import optimizer as optim_module

        self.finder.install_hooks()
        self._handles.append(optim_module.register_optimizer_step_post_hook(self._opt_post))
        self.patches.install()
        self.outlet.start([d.name for d in self.detectors])
        self.dispatch.arrange()
        self.dispatch.set_up(list(self.detectors), self.ctx)

    def uninstall(self) -> None:
        global _SESSION
        self.finder.end_hooks(self._closed)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.patches.restore()
        if _SESSION is self:
            _SESSION = None

    def close(self, exit_code: int) -> None:
        """Flush the last partial step, let detectors finish, write the end record (once)."""
        if self._closed:
            return
        self._closed = True
        Detector.paused = False  # the end is no block: every detector finishes
        unmarked = self.clock.unmarked(self.step)
        if unmarked is not None:
            self.harness_finding(Severity.WARNING, "step boundaries", unmarked[0], fix=unmarked[1])
        self.dispatch.end()
        self._emit_cost()  # before the exchange's thread ends: its CPU time is still counted
        self._close_exchange(clean=False)
        self.release_groups()
        self.release_stale_defaults()
        alive = teardown.end_of_rank(collect=exit_code == 0)
        self.outlet.end(exit_code, self.step, alive, self._released_defaults)
        self.uninstall()
        if self.writer is not None:
            self.writer.close()

    # ------------------------------------------------------------------ explicit API
    def watch(self, *objects: Any) -> None:
        for obj in objects:
            if isinstance(obj, torch.optim.Optimizer) or _is_deepspeed_optimizer(obj):
                self.ctx.add_optimizer(obj)
                self.source.watched(obj)
            elif isinstance(obj, torch.nn.Module):
                self.finder.note_root(obj)
            elif obj is not None:
                raise TypeError(f"distdebug.watch() takes modules and optimizers, not {type(obj).__name__}")
        if not self.finder.discovering:
            self._emit_discovery()

    def explicit_step(self, loss: Any = None) -> None:
        self.source.explicit()
        if loss is not None:
            self.clock.explicit(loss)
        self.boundary()

    # ------------------------------------------------------------------ what the patches and hooks tell
    def _found_engine(self, module: torch.nn.Module) -> None:
        """Discovery found a DeepSpeed engine: its methods are patched, and its steps mark the boundaries."""
        self.patches.hook_deepspeed_engine(module)
        self.source.engine_found()

    def note_all_reduce(self, tensor: torch.Tensor, group: Any = None) -> None:
        """An all_reduce the script called (runtime.finder: read during discovery only)."""
        self.finder.note_all_reduce(tensor, group)

    def note_loss(self, tensors: Any, divided_by: float = 1.0) -> None:
        """What backward runs on (the loss): called by the backward and DeepSpeed engine patches (``divided_by``:
        the engine's own division of it, ``clock.add_loss``)."""
        t = tensors[0] if isinstance(tensors, (tuple, list)) and len(tensors) == 1 else tensors
        self.clock.count_backward()
        if self.finder.discovering:
            self.ctx.models = self.roots
            self.dispatch.each("before_backward", lambda d: d.before_backward(self.ctx))
        if Detector.paused:  # --measure-overhead's off unit: the bare run's backward (runtime.overhead)
            return
        reduces = self.clock.arrive(self.ctx, lambda: self.roots)
        if self.ctx.end_of_backward:
            localgrads.queue_end_of_backward(t, self.ctx.end_of_backward, reduces)
        self.clock.start()
        self.clock.add_loss(t, sys._getframe(1), divided_by)  # the patch's caller's frame: a framework's division

    def after_backward(self) -> None:
        """A backward call returned (gradients accumulated, and reduced under DDP/FSDP2): detectors
        that read gradients before the script's own clipping do it here (device work, no read)."""
        if not Detector.paused:
            self.dispatch.after_backward()

    def note_scaled(self, scaler: Any, out: Any) -> None:
        """``GradScaler.scale(loss)`` returned ``out`` (loss times the scale): remembered weakly, a few."""
        self.clock.note_scaled(scaler, out)

    def scaler_skipped(self, scaler: Any, optimizer: Any) -> None:
        """``GradScaler.step(optimizer)`` did not call ``optimizer.step()`` (non-finite gradients, which the
        scaler handles by skipping the update and lowering the scale): the step ends here, skipped."""
        if self.source.scaler_skipped(optimizer):
            self.boundary(skipped=True)

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.clock.backward_calls == 0 and clock.not_a_training_step():
            return
        self.clock.optimizer_steps += 1
        what = self.source.optimizer_stepped(opt)
        if what == stepsource.ELSEWHERE:
            if self.finder.discovering:
                self.ctx.add_optimizer(opt)
            return
        if what == stepsource.CLAIMED:  # the first to step, or the next after the script dropped its own
            if not self.finder.discovering and self.step > 0 and not self.phases.watches(opt):
                self._new_phase(opt)  # and it trains parameters no detector watches: a new model
        elif what == stepsource.PRIMARY:
            self.phases.primary_stepped()
        elif not self.finder.discovering and self.source.kind == stepsource.OPTIMIZER and self.phases.note_rival(opt):
            self._rival_phase(opt)
        self.ctx.add_optimizer(opt)
        if self.source.marks(opt):
            self.boundary()

    # ------------------------------------------------------------------ training phases (runtime.phases)
    def _rival_phase(self, opt: Any) -> None:
        """Another optimizer stepped twice in a row, over parameters nobody watches: it starts a new phase."""
        self.step += 1  # its first step, which came before it could be told from a rival's: a bare record
        self.emit(clock.bare_step_record(self.identity.rank, self.step, self.identity.attempt))
        self.source.follow(opt)
        self._new_phase(opt)

    def _new_phase(self, opt: Any) -> None:
        """A new training phase: ``opt`` trains a model the detectors never saw (Phases.retire): the next
        step is a discovery step again (its forward finds the new model), at whose end they attach."""
        self.detectors = self.phases.retire(self.detectors, self.ctx, opt)
        self.finder.forget_roots()

    def _start_phase_discovery(self) -> None:
        """After the boundary that ended the old phase: the new detectors are set up and the next step
        discovers the model, as the first step did."""
        fresh = self.phases.take_fresh()
        self.dispatch.set_up(fresh, self.ctx)
        self.detectors = self.phases.arrange(self.detectors, fresh)
        self.finder.restart()

    def release_stale_defaults(self) -> None:
        """Free the destroyed groups that imported functions still hold as defaults (runtime.teardown)."""
        self._released_defaults += teardown.release_quietly()

    def release_groups(self) -> None:
        """Every rank is ending together (the script destroys its default group): detectors post what
        they still hold, the exchange is drained and its group released, before torch's own go."""
        self.dispatch.each("before_destroy", lambda d: d.before_destroy())
        self._close_exchange(clean=True)

    def _open_exchange(self) -> None:
        """The rank's one cross-rank exchange (runtime.exchange.open_exchange), once."""
        if self._exchange is None:
            self._exchange = open_exchange(self.identity.rank, self.detectors, self.report, self.ctx.raw_collectives,
                                           lambda why: self.harness_finding(Severity.WARNING, "cross-rank exchange",
                                                                            why))
            self.ctx.exchange = self._exchange

    def _close_exchange(self, clean: bool) -> None:
        if self._exchange is not None:
            self._exchange.close(clean)

    # ------------------------------------------------------------------ step boundary
    def boundary(self, skipped: bool = False, loss_scale: float | None = None) -> None:
        """The end of one optimizer step: count it, emit its record, dispatch it to the detectors.

        ``skipped``: a loss scaler skipped the optimizer's update (an overflow it handled by design);
        ``loss_scale``: the loss scale of this step when known on the host (DeepSpeed's). Its time is
        the session's, less each detector's part (runtime.cost)."""
        off = Detector.paused
        cost.timed(self.ledger, cost.SESSION, self._boundary, skipped, loss_scale)
        try:  # bookkeeping of ours, called from the optimizer's step: it never raises into the script
            self.ledger.step_mode(off)  # what an off step still paid the session: the A/B cannot see it
            self.ledger.end_step(self.detectors, self.step, self.clock.backward_total)
            if checked_step(self.step):
                self._emit_cost()
            if self._ab is not None:
                self._next_block()
            if self.phases.pending:
                self._start_phase_discovery()
        except Exception:
            Detector.paused = False  # a failure of ours never leaves the detectors off

    def _next_block(self) -> None:
        """``--measure-overhead``: this step's time into its block; the detectors on or off for the next."""
        assert self._ab is not None
        cpu = None if torch.cuda.is_initialized() else time.thread_time()  # see overhead.Pairs.step_done
        regions = self.ledger.one_off_regions
        once = regions != self._ab_seen_regions or self.ledger.windows_open > 0
        self._ab_seen_regions = regions
        done = self._ab.step_done(self.step, time.perf_counter(), cpu, once)
        if done is not None:
            self.emit(schema.record(schema.OVERHEAD_BLOCK, rank=self.identity.rank, time=time.time(), **done))
        Detector.paused = not overhead.harness_on(self.step + 1, self._ab.unit)

    def _boundary(self, skipped: bool, loss_scale: float | None) -> None:
        off = Detector.paused  # --measure-overhead's off block: nothing read, no detector called
        self.ledger.off_steps += off
        now = time.perf_counter()
        progress = self.progress
        progress.touch()
        progress.phase = "training"
        self.step += 1
        progress.step = self.step
        if self.finder.discovering:
            self._finish_discovery()
        loss, readout, scale = self._read_step(off)
        event = self.clock.close_step(self.identity.rank, self.step, now, progress, loss, readout, skipped,
                                      loss_scale if loss_scale is not None else scale)
        self.emit(clock.step_record(event, self.identity.attempt, skipped, off))
        self.dispatch.step(event)
        if self._exchange is not None:
            self._exchange.flush()  # this boundary's posts, one round (the same posts on every rank)

    def _emit_cost(self) -> None:
        """The harness's cost so far on this rank (cumulative: the last record wins)."""
        try:
            self.emit(schema.record(schema.HARNESS_COST, rank=self.identity.rank, time=time.time(),
                                    **self.ledger.snapshot()))
        except Exception:  # accounting must never cost the run
            pass

    def _read_step(self, off: bool = False) -> tuple[float | None, dict[str, dict[str, Any]], float | None]:
        """The step's one device-to-host read (StepClock.read). ``off``: the detectors are paused
        (--measure-overhead): no loss is read."""
        return self.clock.read(self.detectors, self.ledger, self.step, off, self._read_failed)

    def _read_failed(self, e: BaseException) -> None:
        self.harness_finding(Severity.WARNING, "step readout", f"the step's read failed ({type(e).__name__}: "
                                                                f"{e}); this step's checks are skipped")

    def _finish_discovery(self) -> None:
        self.finder.discovering = False
        self._emit_discovery()
        self.finder.end_hooks(self._closed)
        blind = self.finder.blind([d.name for d in self.detectors if d.needs_model], self.step)
        if blind is not None:  # never a quiet "No findings.": a run in which these checks saw nothing says so
            self.harness_finding(Severity.WARNING, "discovery", blind[0], fix=blind[1])
        self._open_exchange()
        for det in list(self.phases.take_attach(self.detectors)):
            self.dispatch.run(det, "attach", lambda d: d.attach(self.ctx))
        self.phases.watch(self.finder.trained_parameters(self.ctx))
        if self._exchange is not None:
            self._exchange.flush()

    def _emit_discovery(self) -> None:
        info = self.finder.describe(self.ctx, self.source.kind)
        try:
            self.patches.patch_functional_collectives()
        except Exception:  # unwatched: a NaN through TP communication is then not told from one born there
            pass
        self.emit(schema.record(schema.DISCOVERY, rank=self.identity.rank, step=self.step, **info))

    # ------------------------------------------------------------------ findings and records (runtime.outlet)
    @property
    def findings(self) -> list[Finding]:
        return self.outlet.findings

    @property
    def writer(self) -> EventWriter | None:
        return self.outlet.writer

    def harness_finding(self, severity: Severity, subject: str, message: str, *, fix: str | None = None,
                        evidence: dict | None = None) -> None:
        self.outlet.harness_finding(severity, subject, message, fix=fix, evidence=evidence)

    def report(self, finding: Finding) -> None:
        self.outlet.report(finding)

    def emit(self, rec: dict) -> None:
        """Append one record to this rank's event stream (any thread)."""
        self.outlet.emit(rec)


def _is_deepspeed_optimizer(obj: Any) -> bool:
    return type(obj).__module__.startswith("deepspeed") and hasattr(obj, "step")

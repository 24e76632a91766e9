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

import gc
import sys
import time
import weakref
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from distdebug.artifacts import schema
from distdebug.artifacts.writer import EventWriter
from distdebug.context import RankContext, RankIdentity
from distdebug.envvars import MEASURE_OVERHEAD
from distdebug.envvars import get as env_get
from distdebug.findings import Finding, Severity
from distdebug.runtime import clock, cost, localgrads, overhead
from distdebug.runtime import patches as patches_mod
from distdebug.runtime.clock import StepClock
from distdebug.runtime.detector import Detector
from distdebug.runtime.exchange import Exchange, checked_step
from distdebug.runtime.finder import Finder
from distdebug.runtime.outlet import Outlet
from distdebug.runtime.patches import TorchPatches
from distdebug.runtime.phases import Phases
from distdebug.runtime.progress import Progress
from distdebug.runtime.reexecution import Reexecution

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
        self.detectors = list(detectors)
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
        self.step_source: str | None = None  # "optimizer", "deepspeed" or "explicit"
        self._primary_ref: Any = None  # weakref to the optimizer whose step marks the boundary
        self.clock = StepClock()
        """The step in progress: its loss, counters and time, and the step's read (runtime.clock)."""
        self.reexecution = Reexecution()
        """Whether a step is being re-executed (runtime.reexecution)."""
        self.finder = Finder(self.reexecution, self.clock, self._found_engine)
        """The models found in a phase's first step (runtime.finder)."""
        self.phases = Phases()
        """What tells a new training phase, and the detectors' change-over (runtime.phases)."""
        self._after_backward: list[Detector] = []  # only the detectors that use it are called after a backward
        self._handles: list[Any] = []
        block = int(env_get(MEASURE_OVERHEAD) or 0)
        self._ab = overhead.Blocks(block) if block else None  # attach --measure-overhead (runtime.overhead)
        self.ledger = cost.Ledger()
        """What the harness costs this rank (runtime.cost): hooks, boundary work, reads, threads."""
        self.progress = Progress()
        """What the rank is doing, for the watchdog thread (runtime.progress)."""
        self.inflight: Any = None  # artifacts.inflight.InflightSlot when there is a run directory
        self._released_defaults: list[str] = []
        self._exchange: Exchange | None = None
        self._closed = False

    # ------------------------------------------------------------------ the rooms' public side
    @property
    def replaying(self) -> bool:
        """A step is being re-executed: the session's own module hooks pass (Reexecution.replaying)."""
        return self.reexecution.replaying

    @property
    def replay_step(self) -> int | None:
        """The step being re-executed (None: none is): what an injected fault takes for the step it is in."""
        return self.reexecution.replay_step

    @property
    def replays(self) -> int:
        """Re-executions so far (an injected fault acts once in each execution of its step)."""
        return self.reexecution.replays

    def replay(self, step: int) -> AbstractContextManager[None]:
        """For the length of a re-execution of ``step`` on this rank (Reexecution.replay)."""
        return self.reexecution.replay(step)

    @property
    def roots(self) -> list[torch.nn.Module]:
        """The models found so far (outermost module of each forward), in the order first seen."""
        return self.finder.roots

    @property
    def optimizer_steps(self) -> int:
        """optimizer.step() calls seen (any optimizer): tells a step a scaler skipped (StepClock)."""
        return self.clock.optimizer_steps

    @optimizer_steps.setter
    def optimizer_steps(self, value: int) -> None:
        self.clock.optimizer_steps = value

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        global _SESSION
        _SESSION = self
        patches_mod.LEDGER = self.ledger  # the wrappers' bookkeeping counts as the session's
        from torch.optim import optimizer as optim_module

        self.finder.install_hooks()
        self._handles.append(optim_module.register_optimizer_step_post_hook(self._opt_post))
        self.patches.install()
        self.emit(
            schema.record(
                schema.START,
                rank=self.identity.rank,
                local_rank=self.identity.local_rank,
                world_size=self.identity.world_size,
                local_world_size=self.identity.local_world_size,
                node=self.identity.node,
                attempt=self.identity.attempt,
                host=self.identity.host,
                pid=self.identity.pid,
                time=time.time(),
                detectors=[d.name for d in self.detectors],
            )
        )
        # Only the detectors that use it are called after every backward.
        self._after_backward = [d for d in self.detectors if type(d).after_backward is not Detector.after_backward]
        for det in list(self.detectors):
            det.on_failure = self._detector_failed
            self._run_detector(det, "setup", lambda d: d.setup(self.ctx))

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
        # Backward calls after the last boundary belong to an unfinished step: not counted.
        if self.step == 0 and self.clock.backward_total > 0:
            self.harness_finding(
                Severity.WARNING,
                "step boundaries",
                f"{self.clock.backward_total} backward calls but no step boundary: the loop does not call a "
                "torch.optim optimizer's step()",
                fix="call distdebug.step(loss) once per training step (and distdebug.watch(model))",
            )
        for det in list(self.detectors):
            self._run_detector(det, "on_end", lambda d: d.on_end())
            det.remove_hooks()
        self._emit_cost()  # before the exchange's thread ends: its CPU time is still counted
        self._close_exchange(clean=False)
        self.release_groups()
        self.release_stale_defaults()
        if exit_code == 0:
            # The script has returned: what it built and left in reference cycles (models whose
            # FSDP/DeepSpeed state holds process groups) is freed now, on this thread, rather than
            # in interpreter teardown (runtime.teardown says why).
            gc.collect()
        try:
            from distdebug.runtime import teardown

            alive = teardown.alive()
        except Exception:
            alive = {}
        self.emit(
            schema.record(
                schema.END,
                rank=self.identity.rank,
                exit_code=exit_code,
                steps=self.step,
                time=time.time(),
                write_errors=self.writer.failed_writes if self.writer else 0,
                # What will meet interpreter teardown: the advice if the process aborts after this.
                alive=alive,
                released_defaults=self._released_defaults[:20],
            )
        )
        self.uninstall()
        if self.writer is not None:
            self.writer.close()

    # ------------------------------------------------------------------ explicit API
    def watch(self, *objects: Any) -> None:
        for obj in objects:
            if isinstance(obj, torch.optim.Optimizer) or _is_deepspeed_optimizer(obj):
                self.ctx.add_optimizer(obj)
                if self._primary() is None:
                    self._primary_ref = weakref.ref(obj)
            elif isinstance(obj, torch.nn.Module):
                self.finder.note_root(obj)
            elif obj is not None:
                raise TypeError(f"distdebug.watch() takes modules and optimizers, not {type(obj).__name__}")
        if not self.finder.discovering:
            self._emit_discovery()

    def explicit_step(self, loss: Any = None) -> None:
        self.step_source = "explicit"
        if loss is not None:
            self.clock.explicit(loss)
        self.boundary()

    # ------------------------------------------------------------------ what the patches and hooks tell
    def _found_engine(self, module: torch.nn.Module) -> None:
        """Discovery found a DeepSpeed engine: its methods are patched, and its steps mark the boundaries."""
        self.patches.hook_deepspeed_engine(module)
        self.step_source = "deepspeed" if self.step_source in (None, "optimizer") else self.step_source

    def _primary(self) -> Any:
        return self._primary_ref() if self._primary_ref is not None else None

    def note_all_reduce(self, tensor: torch.Tensor, group: Any = None) -> None:
        """An all_reduce the script called (runtime.finder: read during discovery only)."""
        self.finder.note_all_reduce(tensor, group)

    def note_loss(self, tensors: Any) -> None:
        """What backward runs on (the loss): called by the backward and DeepSpeed engine patches."""
        t = tensors[0] if isinstance(tensors, (tuple, list)) and len(tensors) == 1 else tensors
        self.clock.count_backward()
        if self.finder.discovering:
            self.ctx.models = self.roots
            for det in list(self.detectors):
                self._run_detector(det, "before_backward", lambda d: d.before_backward(self.ctx))
        if self.ctx.end_of_backward:
            localgrads.queue_end_of_backward(t, self.ctx.end_of_backward)
        self.clock.arrive(self.ctx, lambda: self.roots)
        self.clock.start()
        self.clock.add_loss(t, sys._getframe(1))  # the patch's caller's frame: a framework's division is there

    def after_backward(self) -> None:
        """A backward call returned (gradients accumulated, and reduced under DDP/FSDP2): detectors
        that read gradients before the script's own clipping do it here (device work, no read)."""
        for det in self._after_backward:
            if not det.off and not det.paused:
                self._run_detector(det, "after_backward", lambda d: d.after_backward())

    def note_scaled(self, scaler: Any, out: Any) -> None:
        """``GradScaler.scale(loss)`` returned ``out`` (loss times the scale): remembered weakly, a few."""
        self.clock.note_scaled(scaler, out)

    def scaler_skipped(self, scaler: Any, optimizer: Any) -> None:
        """``GradScaler.step(optimizer)`` did not call ``optimizer.step()`` (non-finite gradients, which the
        scaler handles by skipping the update and lowering the scale): the step ends here, skipped."""
        if self.step_source in ("explicit", "deepspeed"):
            return
        if self._primary() is None:
            self._primary_ref = weakref.ref(optimizer)
        if optimizer is self._primary():
            self.step_source = "optimizer"
            self.boundary(skipped=True)

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.clock.backward_calls == 0 and clock.not_a_training_step():
            return
        self.optimizer_steps += 1
        if self.step_source in ("explicit", "deepspeed"):
            if self.finder.discovering:
                self.ctx.add_optimizer(opt)
            return
        if self._primary() is None:
            # The first optimizer to step marks the boundaries; if the script drops it and builds
            # another (a fresh optimizer per step, a rebuild after a restart), the next one does.
            self._primary_ref = weakref.ref(opt)
            if not self.finder.discovering and self.step > 0 and not self.phases.watches(opt):
                self._new_phase(opt)  # and it trains parameters no detector watches: a new model
        elif opt is self._primary():
            self.phases.primary_stepped()
        elif not self.finder.discovering and self.step_source == "optimizer":
            if self.phases.note_rival(opt):
                self._rival_phase(opt)
        self.ctx.add_optimizer(opt)
        if opt is self._primary():
            self.step_source = "optimizer"
            self.boundary()

    # ------------------------------------------------------------------ training phases (runtime.phases)
    def _rival_phase(self, opt: Any) -> None:
        """Another optimizer stepped twice in a row, over parameters nobody watches: it starts a new phase."""
        self.step += 1  # its first step, which came before it could be told from a rival's: a bare record
        self.emit(clock.bare_step_record(self.identity.rank, self.step, self.identity.attempt))
        self._primary_ref = weakref.ref(opt)
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
        for det in fresh:
            det.on_failure = self._detector_failed
            self._run_detector(det, "setup", lambda d: d.setup(self.ctx))
        self.detectors = self.phases.arrange(self.detectors, fresh)
        self._after_backward = [d for d in self.detectors if type(d).after_backward is not Detector.after_backward]
        self.finder.restart()

    def release_stale_defaults(self) -> None:
        """Free the destroyed groups that imported functions still hold as defaults (runtime.teardown)."""
        try:
            from distdebug.runtime import teardown

            self._released_defaults += teardown.release_stale_defaults()
        except Exception:  # a clean teardown is a courtesy; it must never fail the script
            pass

    def release_groups(self) -> None:
        """Every rank is ending together (the script destroys its default group): detectors post what
        they still hold, the exchange is drained and its group released, before torch's own go."""
        for det in list(self.detectors):
            self._run_detector(det, "before_destroy", lambda d: d.before_destroy())
        self._close_exchange(clean=True)

    def _open_exchange(self) -> None:
        """The rank's one cross-rank exchange, made at the first step boundary on every rank alike
        (new_group is collective), when some detector uses it and there are peers."""
        if self._exchange is not None or not any(getattr(d, "uses_exchange", False) for d in self.detectors):
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        try:
            self._exchange = Exchange(self.identity.rank, self.report, self.ctx.raw_collectives)
            self.ctx.exchange = self._exchange
        except Exception as e:  # no exchange: the cross-rank checks are off, training goes on
            self.harness_finding(Severity.WARNING, "cross-rank exchange",
                                  f"could not create the harness's process group ({type(e).__name__}: {e}); "
                                  "cross-rank checks are off on this rank")

    def _close_exchange(self, clean: bool) -> None:
        if self._exchange is not None:
            self._exchange.close(clean)

    # ------------------------------------------------------------------ step boundary
    def boundary(self, skipped: bool = False, loss_scale: float | None = None) -> None:
        """The end of one optimizer step: count it, emit its record, dispatch it to the detectors.

        ``skipped``: a loss scaler skipped the optimizer's update (an overflow it handled by design);
        ``loss_scale``: the loss scale of this step when known on the host (DeepSpeed's). Its time is
        the session's, less each detector's part (runtime.cost)."""
        cost.timed(self.ledger, cost.SESSION, self._boundary, skipped, loss_scale)
        try:  # bookkeeping of ours, called from the optimizer's step: it never raises into the script
            self.ledger.end_step(self.detectors, self.step)
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
        ab = self._ab
        assert ab is not None
        done = ab.step_done(self.step, time.perf_counter())
        if done is not None:
            self.emit(schema.record(schema.OVERHEAD_BLOCK, rank=self.identity.rank, time=time.time(), **done))
        Detector.paused = not overhead.harness_on(self.step + 1, ab.block)

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
        for det in list(self.detectors):
            # a detector without its own on_step is not called (the base's does nothing): every boundary
            if not det.paused and type(det).on_step is not Detector.on_step:
                self._run_detector(det, "on_step", lambda d: d.on_step(event))
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
        blind = [d.name for d in self.detectors if d.needs_model]
        if not self.roots and blind:
            # Never a quiet "No findings.": a run in which these checks saw nothing says so.
            self.harness_finding(
                Severity.WARNING, "discovery",
                f"no model was found in step {self.step} (no module ran forward before its optimizer step): "
                f"{', '.join(blind)} watch nothing in this run",
                fix="call distdebug.watch(model, optimizer) once they are built; or look for an optimizer.step() "
                    "before the first forward (a helper that steps once to create the optimizer's state)")
        self._open_exchange()
        for det in list(self.phases.take_attach(self.detectors)):
            self._run_detector(det, "attach", lambda d: d.attach(self.ctx))
        self.phases.watch(self.finder.trained_parameters(self.ctx))
        if self._exchange is not None:
            self._exchange.flush()

    def _emit_discovery(self) -> None:
        info = self.finder.describe(self.ctx, self.step_source)
        try:
            self.patches.patch_functional_collectives()
        except Exception:  # unwatched: a NaN through TP communication is then not told from one born there
            pass
        self.emit(schema.record(schema.DISCOVERY, rank=self.identity.rank, step=self.step, **info))

    # ------------------------------------------------------------------ detectors and findings (runtime.outlet)
    def _run_detector(self, det: Detector, phase: str, call: Any) -> None:
        if det.off:
            return
        try:
            # listed inside the timed region: on_step may be a generator, whose work runs as it is read
            for finding in cost.timed(self.ledger, det.name, lambda d: list(call(d) or ()), det):
                self.report(finding)
        except Exception as e:
            det.fail(e, phase)  # switched off on this rank (hooks removed); training goes on untouched

    def _detector_failed(self, det: Detector, e: BaseException, phase: str) -> None:
        """A detector raised (in a step call, a hook or a patch): it is off on this rank, said once."""
        if det in self.detectors:
            self.detectors.remove(det)
        self.outlet.detector_failed(det.name, e, phase)

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

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

The wrappers themselves live in ``runtime.patches``; what the rank is doing (for the watchdog) in
its progress record, ``runtime.progress``. Nothing here touches tensor values, RNG state or the
order of collectives: the harness observes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import traceback
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from distdebug.artifacts import schema
from distdebug.artifacts.writer import EventWriter
from distdebug.context import RankContext, RankIdentity, StepEvent
from distdebug.envvars import MEASURE_OVERHEAD
from distdebug.envvars import get as env_get
from distdebug.findings import Finding, Severity
from distdebug.runtime import cost, discovery, frameworks, overhead
from distdebug.runtime import layout as layout_mod
from distdebug.runtime import patches as patches_mod
from distdebug.runtime.detector import Detector
from distdebug.runtime.exchange import Exchange, checked_step
from distdebug.runtime.patches import TorchPatches
from distdebug.runtime.progress import Progress
from distdebug.runtime.readout import Readout

_SESSION: Session | None = None

def current_session() -> Session | None:
    return _SESSION


NOT_TRAINING_STEPS = (("_init_optim_state", f"checkpoint{os.sep}state_dict.py"),)
"""Functions of torch that call ``optimizer.step()`` themselves, not to train: torch.distributed.checkpoint's
state-dict helpers (``get_optimizer_state_dict``, ``set_state_dict``...) step once with lr 0 and zero
gradients to create the optimizer's state before loading into it. Such a step is not counted."""


def _not_a_training_step() -> bool:
    """Whether this optimizer step was called by one of NOT_TRAINING_STEPS (looked up only for a step
    with no backward call since the last boundary: a training step never pays for the walk)."""
    f: Any = sys._getframe(2)
    for _ in range(16):
        if f is None:
            return False
        code = f.f_code
        if any(code.co_name == name and code.co_filename.endswith(tail) for name, tail in NOT_TRAINING_STEPS):
            return True
        f = f.f_back
    return False


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
        self.writer = writer
        self.detectors = list(detectors)
        self.ctx = RankContext(identity, run_dir, rank_dir)
        self.patches = TorchPatches(self)
        self.ctx.report = self.report
        self.ctx.patch = self.patches.patch
        self.ctx.raw_collectives = self.patches.raw_collectives
        self.ctx.communication_observers = self.patches.communication_observers  # one list, shared
        self.ctx.emit = lambda kind, **fields: self.emit(schema.record(kind, rank=identity.rank, time=time.time(),
                                                                        **fields))
        self.echo = echo
        self.step = 0
        self.findings: list[Finding] = []
        self.step_source: str | None = None  # "optimizer", "deepspeed" or "explicit"
        self._primary_ref: Any = None  # weakref to the optimizer whose step marks the boundary
        # The step's losses, summed where they live (float64, one small tensor whatever the number of
        # backward calls: memory stays flat in loops that never step); read once at the boundary.
        self._loss_sum: torch.Tensor | float | None = None
        self._loss_n = 0
        self.optimizer_steps = 0  # optimizer.step() calls seen (any optimizer): tells a step a scaler skipped
        # GradScaler.scale() outputs of this step (weak; a few): backward on one of them records the loss
        # divided by the scale. The scaler last used: its scale is read with the step's values.
        self._scaled: list[tuple[weakref.ref[torch.Tensor], weakref.ref[Any]]] = []
        self._scaler_ref: weakref.ref[Any] | None = None
        self._backward_calls = 0
        self._reduced_at = False  # this step's backward_t is the arrival at a reducing backward
        self._backward_total = 0
        self._seq_at_boundary = 0  # collective_seq at the last step boundary
        self._t_last: float | None = None
        self._depth = 0
        self._discovering = True
        self._discovery_inert = False
        self.replaying = False
        """A step is being re-executed (detectors.rerun, nan_origin's on-demand watch): the session's own
        module hooks pass."""
        self.replay_step: int | None = None
        """The step being re-executed (None: none is): what an injected fault takes for the step it is in."""
        self.replays = 0  # re-executions so far (an injected fault acts once in each execution of its step)
        self._after_backward: list[Detector] = []  # discovery is over but its hooks stay (a compiled model: see below)
        self._root_refs: list[weakref.ref[torch.nn.Module]] = []  # weak: see RankContext
        self._loss_modules: list[str] = []
        self._reduced_ptrs: dict[int, Any] = {}  # data_ptr -> the process group (None: the default one)
        self._forward_groups: set[Any] = set()  # groups all-reduced over inside a forward in step 1
        self._handles: list[Any] = []
        self._discovery_handles: list[Any] = []
        block = int(env_get(MEASURE_OVERHEAD) or 0)
        self._ab = overhead.Blocks(block) if block else None  # attach --measure-overhead (runtime.overhead)
        self.ledger = cost.Ledger()
        """What the harness costs this rank (runtime.cost): hooks, boundary work, reads, threads."""
        self.progress = Progress()
        """What the rank is doing, for the watchdog thread (runtime.progress)."""
        self.inflight: Any = None  # runtime.inflight.InflightSlot when there is a run directory
        self._released_defaults: list[str] = []
        self._exchange: Exchange | None = None
        self._closed = False
        # Training phases (see _new_phase): the parameters the detectors watch, by id (weakly: an id is
        # reused once its tensor is freed); another optimizer that stepped in a row without the primary.
        self._watched: dict[int, weakref.ref[Any]] = {}
        self._rival: weakref.ref[Any] | None = None
        self._rival_steps = 0
        self._to_attach: list[Detector] | None = None  # detectors of a new phase, attached at its discovery
        self._next_phase: list[Detector] = []  # built when the phase changed; set up after that boundary
        self._phase_order: list[Detector] = []

    # ------------------------------------------------------------------ lifecycle
    @contextlib.contextmanager
    def replay(self, step: int) -> Iterator[None]:
        """For the length of a re-execution of ``step`` on this rank: every detector's hooks and patches pass
        (``Detector.paused``), so do the session's own module hooks; injected faults act (their own class
        flag) and see ``step`` as the step they are in (``replay_step``)."""
        paused = Detector.paused
        Detector.paused = True
        self.replaying, self.replay_step = True, step
        self.replays += 1
        try:
            yield
        finally:
            Detector.paused = paused
            self.replaying, self.replay_step = False, None

    def install(self) -> None:
        global _SESSION
        _SESSION = self
        patches_mod.LEDGER = self.ledger  # the wrappers' bookkeeping counts as the session's
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        self._discovery_handles = [
            nn_module.register_module_forward_pre_hook(self._fwd_pre),
            nn_module.register_module_forward_hook(self._fwd_post, always_call=True),
        ]
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
        self._end_discovery_hooks()
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
        if self.step == 0 and self._backward_total > 0:
            self.harness_finding(
                Severity.WARNING,
                "step boundaries",
                f"{self._backward_total} backward calls but no step boundary: the loop does not call a "
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
                self._note_root(obj)
            elif obj is not None:
                raise TypeError(f"distdebug.watch() takes modules and optimizers, not {type(obj).__name__}")
        if not self._discovering:
            self._emit_discovery()

    def explicit_step(self, loss: Any = None) -> None:
        self.step_source = "explicit"
        if loss is not None:
            self._loss_sum = loss.detach().to(torch.float64) if isinstance(loss, torch.Tensor) else float(loss)
            self._loss_n = 1
        self.boundary()

    # ------------------------------------------------------------------ what the patches and hooks tell
    def _fwd_pre(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or self._discovery_inert or self.replaying:  # tracing reads no state first
            return  # traced into a compiled graph: nothing of ours goes in (it would only recompile)
        if self._depth == 0:
            if self._t_last is None:
                self._t_last = time.perf_counter()
            self._note_root(module)
        self._depth += 1

    def _fwd_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or self._discovery_inert or self.replaying:  # tracing reads no state first
            return
        self._depth = max(0, self._depth - 1)

    def _note_root(self, module: torch.nn.Module) -> None:
        if any(module is r for r in self.roots):
            return
        if not discovery.is_model(module):
            if isinstance(module, torch.nn.modules.loss._Loss) and type(module).__name__ not in self._loss_modules:
                self._loss_modules.append(type(module).__name__)
            return
        self._root_refs.append(weakref.ref(module))
        if discovery.is_deepspeed_engine(module):
            self.patches.hook_deepspeed_engine(module)
            self.step_source = "deepspeed" if self.step_source in (None, "optimizer") else self.step_source

    @property
    def roots(self) -> list[torch.nn.Module]:
        """The models found so far (outermost module of each forward), in the order first seen."""
        return [m for m in (r() for r in self._root_refs) if m is not None]

    def _primary(self) -> Any:
        return self._primary_ref() if self._primary_ref is not None else None

    def note_all_reduce(self, tensor: torch.Tensor, group: Any = None) -> None:
        """An all_reduce the script called: during discovery, tells hand-written gradient sync apart, and
        over which group each tensor was reduced (a hand-written layout's data-parallel group)."""
        if not self._discovering:
            return
        if self._depth > 0:
            if group is not None:
                self._forward_groups.add(group)  # inside a forward, over a sub-group: model parallelism by hand
        elif len(self._reduced_ptrs) < 100_000:
            # Outside a forward only: an activation all-reduced in the forward is freed by the end of the
            # step, and a gradient allocated at its address would be taken for one reduced over its group
            # (seen: a flattened-buffer loop with TP layers inferred the TP group as data-parallel).
            self._reduced_ptrs[tensor.data_ptr()] = group

    def note_loss(self, tensors: Any) -> None:
        """What backward runs on (the loss): called by the backward and DeepSpeed engine patches."""
        t = tensors[0] if isinstance(tensors, (tuple, list)) and len(tensors) == 1 else tensors
        self._backward_calls += 1
        self._backward_total += 1
        if self._discovering:
            self.ctx.models = self.roots
            for det in list(self.detectors):
                self._run_detector(det, "before_backward", lambda d: d.before_backward(self.ctx))
        if self.ctx.end_of_backward:
            self._queue_end_of_backward(t)
        if self._backward_calls == 1 or not self._reduced_at:
            # The arrival at the gradient reduction (straggler): the step's first backward, or under
            # accumulation (DDP's no_sync(), accelerate's and Lightning's) the first one that reduces: the
            # micro-batches before it wait for no one, and a slow rank is late there by all of them.
            self.ctx.backward_t = time.monotonic()
            self._reduced_at = not discovery.accumulating([d for d in map(discovery.find_ddp, self.roots) if d])
        if self._t_last is None:
            self._t_last = time.perf_counter()
        if isinstance(t, torch.Tensor) and t.numel() == 1:
            v = t.detach().to(torch.float64)
            if frameworks.loaded():  # accelerate's or Lightning's division by the accumulation steps, undone
                factor = frameworks.loss_factor(sys._getframe(2))
                if factor != 1.0:
                    v = v * factor
            scaler = next((sc() for out, sc in self._scaled if out() is t), None)
            scale = getattr(scaler, "_scale", None)
            if isinstance(scale, torch.Tensor):
                v = v / scale.detach().to(torch.float64)  # on the device: the loss the script computed
            self._loss_sum = v if self._loss_sum is None else self._loss_sum + v
            self._loss_n += 1

    def _queue_end_of_backward(self, t: Any) -> None:
        """``ctx.end_of_backward`` for this backward: a pre-hook on the graph's root (the first node
        the engine runs) queues them, so they run at the graph's end before anything queued later
        (DDP's reducer queues its finalisation when its last bucket is ready). One hook a backward,
        removed when it has run; a root without a graph (no grad_fn) has no backward to watch."""
        roots = t if isinstance(t, (tuple, list)) else (t,)
        fn = next((r.grad_fn for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is not None), None)
        if fn is None:
            return
        calls = list(self.ctx.end_of_backward)
        handle: list[Any] = []

        def run() -> None:
            for h in handle:  # removed once the graph has run (not from inside its own hook)
                h.remove()
            for call in calls:
                call()  # each is its detector's guarded hook: it never raises

        queued: list[bool] = []

        def queue(grad_outputs: Any) -> None:
            if queued:  # once (a backward that raised left it on a graph retained for another)
                return
            queued.append(True)
            try:
                torch.autograd.Variable._execution_engine.queue_callback(run)
            except Exception:  # never into the backward; the detectors see no local gradients this time
                pass

        handle.append(fn.register_prehook(queue))

    def after_backward(self) -> None:
        """A backward call returned (gradients accumulated, and reduced under DDP/FSDP2): detectors
        that read gradients before the script's own clipping do it here (device work, no read)."""
        for det in self._after_backward:
            if not det.off and not det.paused:
                self._run_detector(det, "after_backward", lambda d: d.after_backward())

    def note_scaled(self, scaler: Any, out: Any) -> None:
        """``GradScaler.scale(loss)`` returned ``out`` (loss times the scale): remembered weakly, a few."""
        if isinstance(out, torch.Tensor) and getattr(scaler, "_enabled", False):
            self._scaled = [*self._scaled[-7:], (weakref.ref(out), weakref.ref(scaler))]
            self._scaler_ref = weakref.ref(scaler)

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
        if self._backward_calls == 0 and _not_a_training_step():
            return
        self.optimizer_steps += 1
        if self.step_source in ("explicit", "deepspeed"):
            if self._discovering:
                self.ctx.add_optimizer(opt)
            return
        if self._primary() is None:
            # The first optimizer to step marks the boundaries; if the script drops it and builds
            # another (a fresh optimizer per step, a rebuild after a restart), the next one does.
            self._primary_ref = weakref.ref(opt)
            if not self._discovering and self.step > 0 and not self._watches(opt):
                self._new_phase(opt)  # and it trains parameters no detector watches: a new model
        elif opt is self._primary():
            self._rival = None
        elif not self._discovering and self.step_source == "optimizer":
            self._note_rival(opt)
        self.ctx.add_optimizer(opt)
        if opt is self._primary():
            self.step_source = "optimizer"
            self.boundary()

    # ------------------------------------------------------------------ training phases
    def _watches(self, opt: Any) -> bool:
        """Whether ``opt`` updates parameters the detectors watch (its first one tells: an optimizer
        over a model is built from that model's parameters)."""
        try:
            p = opt.param_groups[0]["params"][0]
        except Exception:  # nothing to tell by: stay with what is watched
            return True
        ref = self._watched.get(id(p))
        return ref is not None and ref() is p

    def _note_rival(self, opt: Any) -> None:
        """Another optimizer stepped while the primary is alive. Twice in a row without the primary, over
        parameters nobody watches: the script moved on to a new model (a second ``Trainer.fit`` that
        resumes from a checkpoint, the next fold, the next trial) and the old one is merely kept alive.
        A GAN's or a critic's optimizers step between the primary's steps, over watched parameters."""
        if self._rival is not None and self._rival() is opt:
            self._rival_steps += 1
        else:
            self._rival, self._rival_steps = weakref.ref(opt), 1
        if self._rival_steps >= 2 and not self._watches(opt):
            self.step += 1  # its first step, which came before it could be told from a rival's: a bare record
            self.emit(schema.record(schema.STEP, rank=self.identity.rank, step=self.step, attempt=self.identity.attempt,
                                    time=time.time(), loss=None, step_time_s=0.0, backward_calls=0, collectives=0))
            self._primary_ref = weakref.ref(opt)
            self._rival = None
            self._new_phase(opt)

    def _new_phase(self, opt: Any) -> None:
        """A new training phase: ``opt`` trains a model the detectors never saw. Without this the harness
        would go on watching the old model (unchanged, so every check passes) and see nothing of the
        training that goes on. The detectors that watch a model are retired (hooks removed, patches
        passed through) and built afresh, with their options and accounting; the next step is a
        discovery step again (its forward finds the new model), at whose end they attach. The others,
        and injected faults, go on: a checkpoint saved in one phase is compared when the next restores
        it. Every rank runs the same script, so every rank changes phase at the same step."""
        retired, fresh, order = [], [], []  # order: the detectors with the fresh ones in the retired's places
        for det in self.detectors:
            order.append(det)
            if not det.needs_model or det.off:
                continue
            cls = type(det)
            try:
                new = cls(det.config) if cls.Config is not None else cls()  # type: ignore[call-arg]
            except Exception:  # cannot be rebuilt: it stays, watching what it watched
                continue
            new.name = det.name  # type: ignore[misc]
            new.cost_ns, new.cost_calls = det.cost_ns, det.cost_calls  # the run's accounting goes on
            try:
                det.handover(new)
            except Exception:  # nothing passed on: the new one starts as the first phase's did
                pass
            det.off = True
            det.remove_hooks()
            retired.append(det)
            fresh.append(new)
            order[-1] = new
        gone = {id(d) for d in retired}
        lists: list[list[Any]] = [self.ctx.end_of_backward, self.ctx.finding_listeners,
                                  self.ctx.communication_observers]
        for callables in lists:  # what the retired detectors registered with the context
            callables[:] = [c for c in callables if id(getattr(c, "__self__", None)) not in gone]
        self.detectors = [d for d in self.detectors if id(d) not in gone]
        self._next_phase = fresh
        self._phase_order = order
        self.ctx.models = []
        self.ctx.optimizers = [opt]
        self._root_refs = []

    def _start_phase_discovery(self) -> None:
        """After the boundary that ended the old phase: the new detectors are set up and the next step
        discovers the model, as the first step did."""
        fresh, self._next_phase = self._next_phase, []
        for det in fresh:
            det.on_failure = self._detector_failed
            self._run_detector(det, "setup", lambda d: d.setup(self.ctx))
        # In the order of the first phase (injected faults first: a fault's hook on a module runs before
        # the detectors' hooks on it, which then see what it did); detectors added meanwhile stay.
        placed = {id(d) for d in self._phase_order}
        self.detectors = self._phase_order + [d for d in self.detectors if id(d) not in placed]
        self._phase_order = []
        self._after_backward = [d for d in self.detectors if type(d).after_backward is not Detector.after_backward]
        again = [d for d in self.detectors if d.follows_phases and not d.off
                 and (not getattr(d, "acted", False) or getattr(d, "continuing", False))]
        for det in again:
            det.remove_hooks()
        self._to_attach = [d for d in self.detectors if any(d is x for x in fresh + again)]
        self._loss_modules, self._reduced_ptrs, self._forward_groups = [], {}, set()
        self._discovering = True
        if self._discovery_inert:
            self._discovery_inert = False  # a compiled model's: the hooks stayed, inert
        elif not self._discovery_handles:
            from torch.nn.modules import module as nn_module

            self._discovery_handles = [
                nn_module.register_module_forward_pre_hook(self._fwd_pre),
                nn_module.register_module_forward_hook(self._fwd_post, always_call=True),
            ]

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
            if self._next_phase:
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
        if self._discovering:
            self._finish_discovery()
        loss, readout, scale = self._read_step(off)
        event = StepEvent(
            rank=self.identity.rank,
            step=self.step,
            loss=loss,
            step_time_s=(now - self._t_last) if self._t_last is not None else 0.0,
            backward_calls=self._backward_calls,
            collectives=progress.collective_seq - self._seq_at_boundary,
            backward_total=self._backward_total,
            readout=readout,
            skipped=skipped,
            loss_scale=loss_scale if loss_scale is not None else scale,
        )
        self._t_last = now
        self._loss_sum, self._loss_n = None, 0
        self._scaled = []
        self._backward_calls = 0
        self._reduced_at = False
        self._seq_at_boundary = progress.collective_seq
        self.emit(
            schema.record(
                schema.STEP,
                rank=event.rank,
                step=event.step,
                attempt=self.identity.attempt,
                time=time.time(),
                loss=event.loss,
                step_time_s=round(event.step_time_s, 6),
                backward_calls=event.backward_calls,
                collectives=event.collectives,
                **({"skipped": True} if skipped else {}),
                **({"harness": "off"} if off else {}),
                **({"loss_scale": event.loss_scale} if event.loss_scale is not None else {}),
            )
        )
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
        """The step's one device-to-host read: the loss, the loss scale and every detector's probe
        (runtime.readout). ``off``: the detectors are paused (--measure-overhead): no loss is read."""
        readout = Readout()
        loss_sum, n = (None, 0) if off else (self._loss_sum, self._loss_n)
        if isinstance(loss_sum, torch.Tensor) and n:
            try:
                readout.add(("", "loss"), loss_sum)
            except Exception:  # a loss that cannot be read (complex?): the step goes on without it
                loss_sum = None
        scaler = self._scaler_ref() if self._scaler_ref is not None and not off else None
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):
            try:
                readout.add(("", "scale"), scale.reshape(()))
            except Exception:
                pass
        for det in list(self.detectors):
            if det.off or det.paused or type(det).probe is Detector.probe:
                continue
            try:
                for key, value in (cost.timed(self.ledger, det.name, det.probe, self.step) or {}).items():
                    readout.add((det.name, key), value)
            except Exception as e:
                det.fail(e, "probe")
        values: dict[Any, Any] = {}
        if len(readout):
            try:
                self.ledger.reads += 1
                values = readout.read()
            except Exception as e:  # ours; every detector's values are lost this step, training goes on
                self.harness_finding(Severity.WARNING, "step readout", f"the step's read failed ({type(e).__name__}: "
                                                                        f"{e}); this step's checks are skipped")
        per_detector: dict[str, dict[str, Any]] = {}
        for (owner, key), value in values.items():
            if owner:
                per_detector.setdefault(owner, {})[key] = value
        scale_value = values.get(("", "scale"))
        if not n or loss_sum is None:
            return None, per_detector, scale_value
        if isinstance(loss_sum, torch.Tensor):
            total = values.get(("", "loss"))
            return (None if total is None else total / n), per_detector, scale_value
        return float(loss_sum) / n, per_detector, scale_value

    def _finish_discovery(self) -> None:
        self._discovering = False
        self._emit_discovery()
        self._end_discovery_hooks()
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
        attach, self._to_attach = (self.detectors if self._to_attach is None else self._to_attach), []
        for det in list(attach):
            self._run_detector(det, "attach", lambda d: d.attach(self.ctx))
        self._watched = {}
        for p in self._trained_parameters():
            if len(self._watched) < 1_000_000:
                self._watched[id(p)] = weakref.ref(p)
        if self._exchange is not None:
            self._exchange.flush()

    def _trained_parameters(self) -> Any:
        """The parameters of the models found and of the optimizers stepped (each may miss some)."""
        for root in self.roots:
            yield from root.parameters()
        for opt in self.ctx.optimizers:
            for group in getattr(opt, "param_groups", ()):
                yield from group.get("params", ())

    def _end_discovery_hooks(self) -> None:
        # Forward hooks are only for discovery; removing them restores nn.Module's fast path. Not when a
        # model runs compiled: its graphs were traced with the global hooks there (inert while
        # compiling), and removing them would recompile every graph once. They stay, inert.
        if not self._discovering and discovery.any_compiled() and not self._closed:
            self._discovery_inert = True
            return
        for h in self._discovery_handles:
            h.remove()
        self._discovery_handles = []

    def _emit_discovery(self) -> None:
        grad_ptrs = set()
        roots = self.roots
        for root in roots:
            for p in root.parameters():
                if p.grad is not None:
                    grad_ptrs.add(p.grad.data_ptr())
        manual = bool(self._reduced_ptrs.keys() & grad_ptrs)
        # The groups the script all-reduced gradients over by hand, with how many gradients each
        grad_groups: dict[Any, int] = {}
        for ptr in self._reduced_ptrs.keys() & grad_ptrs:
            group = self._reduced_ptrs[ptr]
            grad_groups[group] = grad_groups.get(group, 0) + 1
        self._reduced_ptrs = {}
        models = []
        self.ctx.models = roots
        discovery.mark_compiled(roots)
        for root in roots:
            try:
                models.append(discovery.describe_model(root, manual_grad_collectives=manual))
            except Exception as e:  # a strange module must not break discovery of the others
                models.append({"class": type(root).__name__, "error": repr(e)})
        optimizers = []
        for opt in self.ctx.optimizers:
            try:
                optimizers.append(discovery.describe_optimizer(opt))
            except Exception as e:
                optimizers.append({"class": type(opt).__name__, "error": repr(e)})
        try:
            self.ctx.layout = layout_mod.find_layout(roots, self.identity.rank, self.identity.world_size,
                                                     grad_groups=grad_groups, forward_groups=self._forward_groups)
            self._forward_groups = set()
            described = self.ctx.layout.describe()
        except Exception as e:  # an unknown layout: checks compare as in plain data parallelism
            self.ctx.layout = layout_mod.Layout(rank=self.identity.rank, world=self.identity.world_size)
            described = {"label": None, "error": repr(e)}
        info = {
            "models": models,
            "layout": described,
            "optimizers": optimizers,
            "loss_modules": self._loss_modules,
            "process_group": discovery.describe_process_group(),
            "step_source": self.step_source,
        }
        self.ctx.discovery = info
        try:
            self.patches.patch_functional_collectives()
        except Exception:  # unwatched: a NaN through TP communication is then not told from one born there
            pass
        self.emit(schema.record(schema.DISCOVERY, rank=self.identity.rank, step=self.step, **info))

    # ------------------------------------------------------------------ findings
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
        frames = traceback.extract_tb(e.__traceback__)
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
        self.harness_finding(
            Severity.ERROR,
            f"detector:{det.name}",
            f"detector '{det.name}' raised {type(e).__name__}: {e} in {phase} (at {where}); "
            "switched off on this rank (its hooks removed, its patches passed through)",
            evidence={"exception": type(e).__name__, "phase": phase, "where": where},
        )

    def harness_finding(
        self, severity: Severity, subject: str, message: str, *, fix: str | None = None,
        evidence: dict | None = None,
    ) -> None:
        self.report(
            Finding(
                severity=severity, detector="harness", ranks=[self.identity.rank],
                step=self.step or None, subject=subject, message=message, evidence=evidence or {}, fix=fix,
            )
        )

    def report(self, finding: Finding) -> None:
        self.findings.append(finding)
        self.emit(schema.record(schema.FINDING, rank=self.identity.rank, **finding.to_dict()))
        if self.echo:
            step = f" step {finding.step}" if finding.step is not None else ""
            try:
                print(
                    f"distdebug[rank {self.identity.rank}] {finding.severity.value.upper()}{step} "
                    f"{finding.detector}: {finding.subject}: {finding.message}",
                    file=sys.stderr,
                    flush=True,
                )
            except (OSError, ValueError):  # a closed or broken stderr must not reach the training
                pass
        for listener in list(self.ctx.finding_listeners):
            try:
                listener(finding)
            except Exception:  # a listener must not turn a finding into a failure
                pass

    # ------------------------------------------------------------------ plumbing
    def emit(self, rec: dict) -> None:
        """Append one record to this rank's event stream (any thread)."""
        if self.writer is not None:
            self.writer.write(rec)


def _is_deepspeed_optimizer(obj: Any) -> bool:
    return type(obj).__module__.startswith("deepspeed") and hasattr(obj, "step")

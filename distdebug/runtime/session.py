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

import gc
import sys
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

import torch

from distdebug.artifacts import schema
from distdebug.artifacts.writer import EventWriter
from distdebug.context import RankContext, RankIdentity, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.runtime import discovery
from distdebug.runtime.exchange import Exchange
from distdebug.runtime.patches import TorchPatches
from distdebug.runtime.progress import Progress

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
        self.writer = writer
        self.detectors = list(detectors)
        self.ctx = RankContext(identity, run_dir, rank_dir)
        self.patches = TorchPatches(self)
        self.ctx.report = self.report
        self.ctx.patch = self.patches.patch
        self.ctx.raw_collectives = self.patches.raw_collectives
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
        self._backward_calls = 0
        self._backward_total = 0
        self._seq_at_boundary = 0  # collective_seq at the last step boundary
        self._t_last: float | None = None
        self._depth = 0
        self._discovering = True
        self._root_refs: list[weakref.ref[torch.nn.Module]] = []  # weak: see RankContext
        self._loss_modules: list[str] = []
        self._reduced_ptrs: set[int] = set()
        self._handles: list[Any] = []
        self._discovery_handles: list[Any] = []
        self.progress = Progress()
        """What the rank is doing, for the watchdog thread (runtime.progress)."""
        self.inflight: Any = None  # runtime.inflight.InflightSlot when there is a run directory
        self._released_defaults: list[str] = []
        self._exchange: Exchange | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        global _SESSION
        _SESSION = self
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
        if self._depth == 0:
            if self._t_last is None:
                self._t_last = time.perf_counter()
            self._note_root(module)
        self._depth += 1

    def _fwd_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
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

    def note_all_reduce(self, tensor: torch.Tensor) -> None:
        """An all_reduce the script called: during discovery, tells hand-written gradient sync apart."""
        if self._discovering:
            self._reduced_ptrs.add(tensor.data_ptr())

    def note_loss(self, tensors: Any) -> None:
        """What backward runs on (the loss): called by the backward and DeepSpeed engine patches."""
        t = tensors[0] if isinstance(tensors, (tuple, list)) and len(tensors) == 1 else tensors
        self._backward_calls += 1
        self._backward_total += 1
        if self._backward_calls == 1:
            self.ctx.backward_t = time.monotonic()
        if self._t_last is None:
            self._t_last = time.perf_counter()
        if isinstance(t, torch.Tensor) and t.numel() == 1:
            v = t.detach().to(torch.float64)
            self._loss_sum = v if self._loss_sum is None else self._loss_sum + v
            self._loss_n += 1

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.step_source in ("explicit", "deepspeed"):
            if self._discovering:
                self.ctx.add_optimizer(opt)
            return
        if self._primary() is None:
            # The first optimizer to step marks the boundaries; if the script drops it and builds
            # another (a fresh optimizer per step, a rebuild after a restart), the next one does.
            self._primary_ref = weakref.ref(opt)
        self.ctx.add_optimizer(opt)
        if opt is self._primary():
            self.step_source = "optimizer"
            self.boundary()

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
    def boundary(self) -> None:
        """The end of one optimizer step: count it, emit its record, dispatch it to the detectors."""
        now = time.perf_counter()
        progress = self.progress
        progress.touch()
        progress.phase = "training"
        self.step += 1
        progress.step = self.step
        if self._discovering:
            self._finish_discovery()
        loss = self._mean_loss()
        event = StepEvent(
            rank=self.identity.rank,
            step=self.step,
            loss=loss,
            step_time_s=(now - self._t_last) if self._t_last is not None else 0.0,
            backward_calls=self._backward_calls,
            collectives=progress.collective_seq - self._seq_at_boundary,
            backward_total=self._backward_total,
        )
        self._t_last = now
        self._loss_sum, self._loss_n = None, 0
        self._backward_calls = 0
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
            )
        )
        for det in list(self.detectors):
            self._run_detector(det, "on_step", lambda d: d.on_step(event))
        if self._exchange is not None:
            self._exchange.flush()  # this boundary's posts, one round (the same posts on every rank)

    def _mean_loss(self) -> float | None:
        if self._loss_sum is None or not self._loss_n:
            return None
        # float() of a device tensor waits for that tensor only; on CPU it is free.
        return float(self._loss_sum) / self._loss_n

    def _finish_discovery(self) -> None:
        self._end_discovery_hooks()
        self._discovering = False
        self._emit_discovery()
        self._open_exchange()
        for det in list(self.detectors):
            self._run_detector(det, "attach", lambda d: d.attach(self.ctx))
        if self._exchange is not None:
            self._exchange.flush()

    def _end_discovery_hooks(self) -> None:
        # Forward hooks are only for discovery; removing them restores nn.Module's fast path.
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
        manual = bool(self._reduced_ptrs & grad_ptrs)
        models = []
        self.ctx.models = roots
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
        info = {
            "models": models,
            "optimizers": optimizers,
            "loss_modules": self._loss_modules,
            "process_group": discovery.describe_process_group(),
            "step_source": self.step_source,
        }
        self.ctx.discovery = info
        self.emit(schema.record(schema.DISCOVERY, rank=self.identity.rank, step=self.step, **info))

    # ------------------------------------------------------------------ findings
    def _run_detector(self, det: Detector, phase: str, call: Any) -> None:
        if det.off:
            return
        try:
            for finding in call(det) or ():
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

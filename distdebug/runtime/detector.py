"""The detector interface: step events in, findings out (a plugin imports it from distdebug.detectors.base).

A detector runs inside every rank. It is built once per rank, gets ``attach(ctx)`` after the
first step boundary (when models, optimizers and the process group are known), then
``on_step(event)`` at every step boundary and ``on_end()`` when the script finishes. Any
exception it raises switches that detector off on that rank and becomes a harness finding:
training itself never sees it.

The same holds inside the training's own calls: a detector registers its module hooks with
``self.hook(...)`` and replaces functions with ``self.patch(...)``. An exception of the detector's
own in either switches the detector off on that rank, removes its hooks, turns its patches into
plain calls of what they replaced, and is reported as a harness finding; the training's call goes
on as if the detector were not there (the user's own exceptions pass through untouched).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from time import perf_counter_ns
from typing import Any, ClassVar

# Finding, Severity, StepEvent and RankContext live on the ground floor (distdebug.findings,
# distdebug.context); re-exported, with Detector, by distdebug.detectors.base: a plugin's import.
from distdebug.context import RankContext, StepEvent
from distdebug.findings import Finding, Severity
from distdebug.runtime.cost import claimed

__all__ = ["Detector", "Finding", "RankContext", "Severity", "StepEvent"]


class Detector:
    """Base class; subclasses set ``name`` and ``description`` and override what they need."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    default: ClassVar[bool] = True
    """Whether the detector runs when ``--detectors`` is not given."""
    needs_model: ClassVar[bool] = False
    """Watches the model found by discovery (its modules, parameters or gradients): blind when none is."""
    follows_phases: ClassVar[bool] = False
    """Not rebuilt at a new training phase (runtime.session._new_phase) but attached again to its models
    (injected faults that have not acted yet: the step they act at may lie in the new phase)."""
    Config: ClassVar[type | None] = None
    """A configurable detector's options: a kw_only dataclass, one docstring per field (defaults live
    there and nowhere else). The detector is then built as ``cls(config)``; ``distdebug attach
    --detector-option NAME.KEY=VALUE`` sets a field, typed by its annotation. None: built as ``cls()``."""
    config: Any = None

    def setup(self, ctx: RankContext) -> None:
        """Called once per rank before the script runs (for hooks needed from the first line on)."""

    def before_backward(self, ctx: RankContext) -> None:
        """Called before each backward of step 1 (discovery; ``ctx.models``: the models found so far).
        The moment for what must precede a model's first backward (a DDP communication hook): the
        script has made its own registrations by then."""

    def after_backward(self) -> None:
        """Called after every backward call (from attach on): the gradients as backward left them, before
        anything the script does between backward and the optimizer step (clipping). Device work only."""

    def attach(self, ctx: RankContext) -> None:
        """Called once per rank after discovery (first step boundary)."""

    def handover(self, successor: Detector) -> None:
        """A new training phase (runtime.session._new_phase) retires this detector for ``successor``, built
        afresh for the new model: pass on what is about the training rather than the model (a loss's
        history, say: a resumed training goes on where it stopped). Nothing by default."""

    def probe(self, step: int) -> dict[str, Any] | None:
        """Device values this detector needs on the host at this step boundary (flags, norms,
        fingerprint rows), as tensors, not read: the session reads them all, and the loss, in one
        device-to-host transfer and hands them back in ``on_step``'s event (``self.values(event)``).
        Called at every boundary just before ``on_step``. A detector never reads a device tensor itself:
        on a GPU each read stalls the host until the device catches up (runtime.readout). A value may be a
        list of tensors: it comes back as the list of their values, packed with the rest (no op of the
        detector's own to stack or reduce them)."""
        return None

    def values(self, event: StepEvent) -> dict[str, Any]:
        """What ``probe`` asked for at this boundary, read: {key: number or nested list}."""
        return event.readout.get(self.name, {})

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        return ()

    def on_end(self) -> Iterable[Finding]:
        return ()

    def before_destroy(self) -> None:
        """Called before the script destroys its process groups: release any group of your own."""

    def one_off(self, what: str, count: bool = True, opens: int = 0) -> Any:
        """A context for work done once, not every step (a profiler window's start and export, a re-execution):
        its time is reported apart from the steady per-step cost (runtime.cost.one_off); count: one more time
        of ``what`` (false for the first of two regions of one thing); opens: +1 opening, -1 closing, something
        that lasts over steps (the in-job A/B leaves those steps out)."""
        from distdebug.runtime.cost import one_off

        return one_off(what, count=count, opens=opens)

    # ------------------------------------------------------------------ guarded hooks and patches
    off: bool = False
    """Switched off on this rank (one of its hooks or patches raised): every hook and patch passes."""
    paused: ClassVar[bool] = False
    """Every detector's hooks and patches pass, for now (``attach --measure-overhead``'s off blocks:
    runtime.overhead). Set on the class by the session; the step boundary skips the detectors too."""
    cost_ns: int = 0
    """Training-thread time spent in this detector's hooks and patches so far (runtime.cost)."""
    cost_calls: int = 0
    on_failure: Callable[[Detector, BaseException, str], None] | None = None
    """Set by the session: told when a hook or patch of this detector raised."""

    def fail(self, exc: BaseException, where: str) -> None:
        """Switch off on this rank: hooks removed, patches passed through, the session told."""
        if self.off:
            return
        self.off = True
        self.remove_hooks()
        if self.on_failure is not None:
            try:
                self.on_failure(self, exc, where)
            except Exception:  # reporting a failure must not be one
                pass

    def remove_hooks(self) -> None:
        for h in self.__dict__.get("_guarded_handles", ()):
            try:
                h.remove()
            except Exception:  # already removed with its module
                pass
        self.__dict__["_guarded_handles"] = []

    def guarded(self, fn: Callable[..., Any], fallback: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """``fn`` that never raises into the caller: on an exception the detector is switched off, and
        the call returns ``fallback(*args)`` (None without one: a module hook that changes nothing)."""
        det = self

        import torch

        compiling = torch.compiler.is_compiling
        cls = type(self)  # ``cls.paused``: a fault's class says False whatever the detectors' says

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if compiling():  # traced into a compiled graph: nothing of ours goes in (state read = a guard)
                return fallback(*args, **kwargs) if fallback is not None else None
            if not det.off and not cls.paused:
                t0 = perf_counter_ns()
                c0 = claimed()
                try:
                    return fn(*args, **kwargs)
                except Exception as e:
                    det.fail(e, getattr(fn, "__qualname__", "a hook"))
                finally:  # less what a one-off inside claimed (a re-execution started from a finding listener)
                    det.cost_ns += perf_counter_ns() - t0 - (claimed() - c0)
                    det.cost_calls += 1
            return fallback(*args, **kwargs) if fallback is not None else None

        return call

    def hook(self, module: Any, kind: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """``module.register_<kind>_hook(fn)`` (kind: forward, forward_pre, full_backward...), guarded,
        and removed when the detector is switched off (or by ``remove_hooks()`` at its end).

        A module that runs inside a torch.compile'd region gets no module hook (returns None): the hook
        would be traced into the graph, and adding one, or a flag it reads changing, recompiles it
        (``discovery.runs_compiled``). Hook the compiled wrapper instead, which runs eagerly."""
        from distdebug.runtime.discovery import runs_compiled

        if kind.startswith(("forward", "full_backward")) and runs_compiled(module):
            return None
        handle = getattr(module, f"register_{kind}_hook")(self.guarded(fn), **kwargs)
        self.__dict__.setdefault("_guarded_handles", []).append(handle)
        return handle

    def patch_clip_grad_norm(self, ctx: RankContext, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """``patch`` torch.nn.utils.clip_grad_norm_ under both names torch keeps it (``torch.nn.utils`` and
        ``torch.nn.utils.clip_grad``, while they are the same function): a script may call either."""
        import torch.nn.utils.clip_grad as clip_module
        from torch.nn import utils as nn_utils

        original = nn_utils.clip_grad_norm_
        self.patch(ctx, nn_utils, "clip_grad_norm_", make)
        if getattr(clip_module, "clip_grad_norm_", None) is original:
            self.patch(ctx, clip_module, "clip_grad_norm_", make)

    def patch(self, ctx: RankContext, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
              ) -> None:
        """Replace ``obj.name`` with ``make(original)``, guarded (until the session ends).

        ``make`` gets the original and returns the replacement, which calls it. If the replacement
        raises an exception of its own (not one the original raised), the detector is switched off
        and the call still happens: the original's result if it already ran, else the original now.
        Once off, the replacement is skipped altogether.
        """
        original = getattr(obj, name)
        det = self
        local = threading.local()

        cls = type(self)

        def call_original(*args: Any, **kwargs: Any) -> Any:
            t0 = perf_counter_ns()
            try:
                out = original(*args, **kwargs)
            except BaseException as e:
                try:
                    e._distdebug_passthrough = True  # type: ignore[attr-defined]
                except Exception:  # an exception type without a __dict__: still the user's
                    pass
                raise
            finally:
                local.inner = getattr(local, "inner", 0) + perf_counter_ns() - t0  # the training's time
            local.done = (out,)
            return out

        replacement = make(call_original)

        @functools.wraps(original)
        def patched(*args: Any, **kwargs: Any) -> Any:
            if det.off or cls.paused:
                return original(*args, **kwargs)
            local.done = None
            outer = getattr(local, "inner", 0)  # a patched call inside another (recursion): kept apart
            local.inner = 0
            t0 = perf_counter_ns()
            c0 = claimed()
            try:
                return replacement(*args, **kwargs)
            except Exception as e:
                if getattr(e, "_distdebug_passthrough", False):
                    raise
                det.fail(e, f"{getattr(obj, '__name__', type(obj).__name__)}.{name}")
                done = local.done
                return done[0] if done is not None else original(*args, **kwargs)
            finally:
                det.cost_ns += max(0, perf_counter_ns() - t0 - local.inner - (claimed() - c0))
                det.cost_calls += 1
                local.inner = outer

        ctx.patch(obj, name, patched)

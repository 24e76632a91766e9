"""Every function distdebug replaces in torch (and on a DeepSpeed engine), in one place.

This is the fragile part of zero-code instrumentation: it follows torch's API as torch calls it
(``Tensor.backward`` calls ``torch.autograd.backward``; ``torch.distributed``'s Python collectives;
``init_process_group`` / ``destroy_process_group``; ``os._exit``) and DeepSpeed's engine methods, so
it is read, guarded and changed together. Each wrapper tells the session what happened through the
session's public methods and the rank's progress record (``runtime.progress``), then calls the
original with the caller's arguments unchanged: nothing here touches tensor values, RNG state or
the order of collectives. Every replacement is undone by ``restore()``. The harness's own part of
each wrapper is guarded (``quietly``): an exception of ours never stops the call the script made.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from typing import Any, Protocol

import torch

from distdebug.artifacts import schema
from distdebug.context import RankIdentity
from distdebug.runtime import cost, teardown
from distdebug.runtime.callinfo import P2P, call_shapes, call_site, p2p_peer
from distdebug.runtime.clock import StepClock
from distdebug.runtime.progress import Progress
from distdebug.runtime.stepsource import StepSource

# Python-level collectives of torch.distributed that are counted. DDP's reducer and NCCL calls
# made from C++ do not pass through Python and are not counted here.
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "barrier", "send", "recv", "isend", "irecv", "gather", "scatter",
)


class Observer(Protocol):
    """What the wrappers tell: the session's public side (runtime.session.Session implements it)."""

    identity: RankIdentity
    progress: Progress
    inflight: Any
    source: StepSource

    def note_loss(self, tensors: Any, divided_by: float = 1.0) -> None: ...
    def note_scaled(self, scaler: Any, out: Any) -> None: ...
    def after_backward(self) -> None: ...
    def scaler_skipped(self, scaler: Any, optimizer: Any) -> None: ...
    clock: StepClock
    def note_all_reduce(self, tensor: torch.Tensor, group: Any = None) -> None: ...
    def boundary(self, skipped: bool = False, loss_scale: float | None = None) -> None: ...
    def emit(self, rec: dict) -> None: ...
    def release_groups(self) -> None: ...
    def release_stale_defaults(self) -> None: ...
    def close(self, exit_code: int) -> None: ...


quietly = cost.quietly


FUNCTIONAL_COLLECTIVES = (
    "all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all_single", "all_reduce_coalesced", "all_gather_tensor_autograd", "all_gather_single_autograd",
    "reduce_scatter_tensor_autograd", "reduce_scatter_single_autograd", "all_to_all_single_autograd",
    "all_gather_inplace", "all_reduce_inplace", "all_gather_tensor_inplace", "reduce_scatter_tensor_inplace",
)
"""Functions of ``torch.distributed._functional_collectives`` that communicate (those torch 2.13 has)."""


def _observed(fn: Any, observers: list[Any]) -> Any:
    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced into a graph: nothing of ours runs there
            return fn(*args, **kwargs)
        out = fn(*args, **kwargs)
        for observe in observers:  # what went in and what came out (detectors' device flags, no read)
            quietly(observe, args[0] if args else kwargs.get("self", kwargs.get("input")), out)
        return out
    return counted


IDENTITY_CHECKED = ("isend", "irecv")
"""Collectives torch checks by identity (``dist.P2POp``, ``batch_isend_irecv``): every pipeline schedule
(``torch.distributed.pipelining``) and Megatron's P2P communication build P2POps from them."""


class TorchPatches:
    """The session's replacements of torch functions, installed once per rank and restored at its end."""

    def __init__(self, session: Observer) -> None:
        self.session = session
        self.raw_collectives: dict[str, Any] = {}
        """torch.distributed's collectives as they were before they were wrapped (the harness's own use)."""
        self._restore: list[tuple[Any, str, Any]] = []
        self._in_engine_backward = False
        self.direct_division: Any = None  # a DeepSpeed engine's division of a direct backward (engine_hooks)
        import weakref

        # Async works the script holds, with the operation that made them (weak: a work dropped unwaited
        # leaves nothing behind)
        self._works: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
        self.communication_observers: list[Any] = []
        """Callables(input, output) told of each functional collective (DTensor's communication)."""

    def patch(self, obj: Any, name: str, replacement: Any) -> None:
        """Replace ``obj.name`` until ``restore()``."""
        self._restore.append((obj, name, getattr(obj, name)))
        setattr(obj, name, replacement)

    def restore(self) -> None:
        for obj, name, original in reversed(self._restore):
            setattr(obj, name, original)
        self._restore.clear()

    def _note_work(self, work: Any, info: dict[str, Any] | None) -> None:
        if info is not None:
            self._works[work] = info

    def _wrap_batch(self, original: Any) -> Any:
        """``batch_isend_irecv``: its operations are counted one by one (P2POp calls the wrapped isend and
        irecv); the works it returns are noted with the whole batch, for their wait()."""
        patches = self

        @functools.wraps(original)
        def batch_isend_irecv(p2p_op_list: Any) -> Any:
            before = patches.session.progress.p2p_seq
            works = original(p2p_op_list)
            quietly(patches._note_batch, works, p2p_op_list, before)
            return works

        return batch_isend_irecv

    def _note_batch(self, works: Any, ops: Any, before: int) -> None:
        parts = []
        for op in list(ops)[:8]:
            name = getattr(getattr(op, "op", None), "__name__", "?")
            parts.append({"op": name, "peer": getattr(op, "peer", None), "tag": getattr(op, "tag", 0) or 0})
        progress = self.session.progress
        info = {"op": "batch_isend_irecv", "seq": progress.p2p_seq, "first_seq": before + 1,
                "step": progress.step + 1, "ops": parts, "site": call_site(4)}
        for w in works or []:
            if hasattr(w, "wait"):
                self._works[w] = info

    def _wrap_wait(self, original: Any) -> Any:
        """``Work.wait()`` of an async operation the script issued (isend/irecv, a batch of them, an
        async_op collective): where the rank really blocks. Marked in flight like the operation, so a
        hang names it (and its peer) rather than the script's line."""
        patches = self

        @functools.wraps(original)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            info = quietly(patches._works.pop, work, None) if patches._works else None
            if info is None:
                return original(work, *args, **kwargs)
            slot = quietly(patches._enter_flight, {**info, "waiting": True})
            return patches._in_flight(slot, original, work, *args, **kwargs)

        return wait

    def _enter_flight(self, info: dict[str, Any]) -> Any:
        """The training thread enters an operation: its in-flight slot (None without a run directory) and
        progress record say so, for the watchdog and the hang analysis."""
        slot = self.session.inflight
        if slot is not None:
            slot.enter(info)
        self.session.progress.in_collective = {**info, "since": time.monotonic()}
        return slot

    def _in_flight(self, slot: Any, call: Any, *args: Any, **kwargs: Any) -> Any:
        """Run the script's operation, then mark it left (or failed, if it raised), whatever happens."""
        progress = self.session.progress
        try:
            out = call(*args, **kwargs)
        except BaseException:
            if slot is not None:
                quietly(slot.fail)
            raise
        finally:
            progress.in_collective = None
            progress.touch()
        if slot is not None:
            quietly(slot.leave)
        return out

    def patch_functional_collectives(self) -> None:
        """Watch torch's functional collectives (``torch.distributed._functional_collectives``: what DTensor
        redistribution, TP layers and context parallelism communicate with), once that module is in use:
        observers see each call's input and output (a NaN received there is not born there). Called at
        the end of discovery, never importing it; only while an observer is registered does it cost."""
        mod = sys.modules.get("torch.distributed._functional_collectives")
        if mod is None or getattr(self, "_funcol_patched", False):
            return
        self._funcol_patched = True
        for name in FUNCTIONAL_COLLECTIVES:
            fn = getattr(mod, name, None)
            if callable(fn):
                self.patch(mod, name, _observed(fn, self.communication_observers))

    def install(self) -> None:
        self.patch(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward))
        from torch.nn.parallel import DistributedDataParallel

        self.patch(DistributedDataParallel, "__init__", self._wrap_ddp_init(DistributedDataParallel.__init__))
        scaler_cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if scaler_cls is not None:  # torch.cuda.amp's and torch.cpu.amp's GradScaler are subclasses of it
            self.patch(scaler_cls, "scale", self._wrap_scaler_scale(scaler_cls.scale))
            self.patch(scaler_cls, "step", self._wrap_scaler_step(scaler_cls.step))
        self.patch(os, "_exit", self._wrap_os_exit(os._exit))
        import torch.distributed as dist

        if dist.is_available():
            self.patch(dist, "init_process_group", self._wrap_init(dist.init_process_group))
            self.patch(dist, "destroy_process_group", self._wrap_destroy(dist.destroy_process_group))
            c10d = dist.distributed_c10d
            for name in COLLECTIVES:
                fn = getattr(dist, name, None)
                if callable(fn):
                    self.raw_collectives[name] = fn
                    wrapper = self._wrap_collective(name, fn)
                    self.patch(dist, name, wrapper)
                    if name in IDENTITY_CHECKED and getattr(c10d, name, None) is fn:
                        # The same wrapper in c10d's own namespace: P2POp and batch_isend_irecv check the
                        # op by identity against these globals (``op in [isend, irecv]``, ``op is isend``).
                        self.patch(c10d, name, wrapper)
            batch = getattr(dist, "batch_isend_irecv", None)
            if callable(batch):
                self.patch(dist, "batch_isend_irecv", self._wrap_batch(batch))
            work = getattr(dist, "Work", None)
            if work is not None and callable(getattr(work, "wait", None)):
                self.patch(work, "wait", self._wrap_wait(work.wait))

    # ------------------------------------------------------------------ autograd and DeepSpeed
    def _wrap_backward(self, original: Any) -> Any:
        patches = self

        @functools.wraps(original)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if patches._in_engine_backward:
                return original(tensors, *args, **kwargs)
            divide = patches.direct_division if patches.session.clock.keep_raw else None  # the raw loss's only
            quietly(patches.session.note_loss, tensors, (quietly(divide) if divide is not None else None) or 1.0)
            out = original(tensors, *args, **kwargs)
            quietly(patches.session.after_backward)
            return out

        return backward

    def _wrap_ddp_init(self, original: Any) -> Any:
        """Note every DDP wrapper built (weakly): the replica check tells 'DDP reduced nothing' from the rest."""

        @functools.wraps(original)
        def __init__(ddp: Any, *args: Any, **kwargs: Any) -> None:
            original(ddp, *args, **kwargs)
            from distdebug.runtime import discovery

            quietly(discovery.note_ddp, ddp)
            quietly(discovery.note_ddp_params, ddp)  # by name, before TP parameters leave named_parameters()
            quietly(discovery.note_ddp_builder, ddp, sys._getframe(1))  # a framework's options, or the script's

        return __init__

    def _wrap_scaler_scale(self, original: Any) -> Any:
        """``GradScaler.scale(loss)``: what backward will run on is the loss times the scale; the session
        records the loss itself (the scaled one divided by the scale, on the device)."""
        session = self.session

        @functools.wraps(original)
        def scale(scaler: Any, outputs: Any) -> Any:
            out = original(scaler, outputs)
            quietly(session.note_scaled, scaler, out)
            return out

        return scale

    def _wrap_scaler_step(self, original: Any) -> Any:
        """``GradScaler.step(optimizer)``: it calls ``optimizer.step()`` only when the gradients are finite.
        When it did not (an overflow the scaler handled, by design), the step still ends here, marked
        skipped: no NaN finding, no spike, and the next step's checks start clean. Known on the host
        (whether the optimizer's step ran), without reading the scaler's flags."""
        session = self.session

        @functools.wraps(original)
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before = session.clock.optimizer_steps
            out = original(scaler, optimizer, *args, **kwargs)
            if session.clock.optimizer_steps == before and getattr(scaler, "_enabled", False):
                quietly(session.scaler_skipped, scaler, optimizer)
            return out

        return step

    def hook_deepspeed_engine(self, engine: Any) -> None:
        """Step and loss from the engine itself (runtime.engine_hooks)."""
        from distdebug.runtime.engine_hooks import hook_deepspeed_engine

        hook_deepspeed_engine(self, engine)

    # ------------------------------------------------------------------ process groups and exit
    def _wrap_init(self, original: Any) -> Any:
        """Record entering and leaving init_process_group: a rank stuck there names a startup hang."""
        session = self.session
        progress = session.progress

        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            quietly(teardown.note_first_group)
            progress.phase = "init_process_group"
            progress.touch()
            quietly(session.emit, schema.record(schema.PG_INIT, rank=session.identity.rank, phase="begin",
                                                 time=time.time()))
            result = original(*args, **kwargs)
            progress.phase = "training"
            progress.touch()
            quietly(session.emit, schema.record(schema.PG_INIT, rank=session.identity.rank, phase="done",
                                                 time=time.time()))
            return result

        return init_process_group

    def _wrap_os_exit(self, original: Any) -> Any:
        """A script that leaves with os._exit (a common way around teardown aborts) still gets its end.

        Only this process's main thread closes the session: a forked child (a DataLoader worker)
        or a thread of ours leaving by os._exit must not write this rank's end record.
        """
        session, pid = self.session, os.getpid()

        @functools.wraps(original)
        def _exit(code: int) -> Any:
            if os.getpid() == pid and threading.current_thread() is threading.main_thread():
                try:
                    session.close(int(code))
                except Exception:  # leaving is what the script asked for; nothing of ours may stop it
                    pass
            return original(code)

        return _exit

    def _wrap_destroy(self, original: Any) -> Any:
        """Let detectors release process groups of their own before the script tears all of them down.

        A group that outlives the default one is destroyed during interpreter shutdown, where gloo
        aborts the process ("terminate called without an active exception").
        """
        session = self.session

        @functools.wraps(original)
        def destroy_process_group(group: Any = None) -> Any:
            if group is None:
                quietly(session.release_groups)
            out = original(group)
            if group is None:
                quietly(session.release_stale_defaults)
            return out

        return destroy_process_group

    # ------------------------------------------------------------------ collectives
    def _wrap_collective(self, name: str, fn: Any) -> Any:
        session = self.session
        progress = session.progress

        def describe(args: Any, kwargs: Any) -> dict[str, Any]:
            # Point-to-point operations are numbered apart: pipeline stages issue different numbers of
            # them (a middle stage twice an end stage's), and the per-step collective counts and sequence
            # numbers the hang analysis compares across ranks must not differ by design.
            if name in P2P:
                progress.p2p_seq += 1
                seq = progress.p2p_seq
            else:
                progress.collective_seq += 1
                seq = progress.collective_seq
            t = args[0] if args else kwargs.get("tensor")
            if name == "all_reduce" and isinstance(t, torch.Tensor):
                session.note_all_reduce(t, kwargs.get("group", args[2] if len(args) > 2 else None))
            info = {"op": name, "seq": seq, "step": progress.step + 1,
                    "shapes": call_shapes(args, kwargs),
                    "site": call_site(3)}  # describe <- quietly <- collective <- its caller
            if name in P2P:
                info.update(p2p_peer(name, args, kwargs))
            return info

        patches = self

        @functools.wraps(fn)
        def collective(*args: Any, **kwargs: Any) -> Any:
            info = quietly(describe, args, kwargs)
            slot = quietly(patches._enter_flight, info) if info is not None else None
            out = patches._in_flight(slot, fn, *args, **kwargs)
            if info is not None and out is not None and hasattr(out, "wait"):  # async: its wait() is where it blocks
                quietly(patches._note_work, out, info)
            return out

        return collective

"""This rank's local gradients, normed once a step for every detector that wants them.

Under DDP's default (``gradient_as_bucket_view=False``) the reducer reduces copies of the gradients and
writes the reduced ones back into ``.grad`` when it finalises, at the end of the backward; a callback
queued when the backward starts (``ctx.end_of_backward``) runs before that and sees each rank's own
gradients. Two detectors want them there: ``nan_origin`` (a non-finite local gradient names the rank a
NaN started on) and ``loss_spike`` (the gradient norm of the rank whose batch spiked). On a model of a
few MB the pass over the gradients is memory-bound, about as long as the optimizer's own (issue 37: 0.33
ms a pass on the GPT recipe, where each detector made its own): one fused ``_foreach_norm`` a syncing
backward serves both. The norms are 2-norms in float32 (an fp16 gradient's own norm overflows past
65504); a NaN or Inf gradient gives a non-finite norm, and so may a finite one past about 1e19 (its
square overflows float32): nan_origin confirms on the rare path (the reduced gradients, the parameters)
before it calls anything non-finite.

Not under ``no_sync()`` (accumulation): those gradients stay local and accumulate into the backward that
syncs, which is the one read. Device work only; nothing is read here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from distdebug.context import RankContext
from distdebug.envvars import device_path_forced
from distdebug.fingerprint.hostpass import HostPass, any_none
from distdebug.runtime.discovery import accumulating, unwrap

Listener = Callable[[tuple[str, ...], torch.Tensor], None]


class LocalGradNorms:
    """Called at the end of each backward (``ctx.end_of_backward``): the norm of each local gradient of one
    DDP model, as one device vector, handed to every listener with the names of the parameters it covers."""

    syncing_only = True
    """Not queued for a backward under ``no_sync()`` (``queue_end_of_backward``): it would return at once."""

    def __init__(self, ddp: Any) -> None:
        self._ddp = weakref.ref(ddp)
        self.named = [(n, p) for n, p in unwrap(ddp)[0].named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        self.names = tuple(n for n, _ in self.named)
        self._host = HostPass()
        self.listeners: list[Listener] = []
        self._keys: dict[tuple[int, ...], tuple[str, ...]] = {}

    def __call__(self) -> None:
        try:
            ddp = self._ddp()
            if ddp is None or not self.listeners or accumulating([ddp]):
                return
            with torch.no_grad():
                grads = [p.grad for p in self.params]
                host = None
                if not any_none(grads) and not device_path_forced():
                    # Every gradient there, on a CPU: one pass on the host (fingerprint.hostpass), where torch's
                    # multi-tensor norm would run a kernel a tensor (3 us each).
                    host = self._host.norms(grads)
                if host is not None:
                    key, norms = self.names, torch.from_numpy(host)
                else:
                    present = [(i, g) for i, g in enumerate(grads) if g is not None and g.layout is torch.strided]
                    if not present:
                        return
                    which = tuple(i for i, _ in present)
                    known = self._keys.get(which)
                    if known is not None:
                        key = known
                    else:
                        if len(self._keys) >= 64:
                            self._keys.clear()
                        key = self._keys[which] = tuple(self.named[i][0] for i in which)
                    norms = torch.stack(torch._foreach_norm([g for _, g in present], 2.0, dtype=torch.float32))
            for listen in self.listeners:
                listen(key, norms)  # each is its detector's guarded hook: it never raises
        except Exception:  # never into the backward: the detectors see no local gradients this time
            pass


def local_grad_norms(ctx: RankContext, ddp: Any) -> LocalGradNorms:
    """The one ``LocalGradNorms`` of ``ddp`` on this rank (made, and queued at every backward's end, by the
    first detector that asks)."""
    shared = ctx.local_grad_norms
    entry = shared.get(id(ddp))
    if entry is None or entry._ddp() is not ddp:
        for old in [e for e in shared.values() if e._ddp() is None]:  # a model gone (a new training phase)
            if old in ctx.end_of_backward:
                ctx.end_of_backward.remove(old)
        shared = ctx.local_grad_norms = {k: e for k, e in shared.items() if e._ddp() is not None}
        entry = shared[id(ddp)] = LocalGradNorms(ddp)
        ctx.end_of_backward.append(entry)
    return entry


def queue_end_of_backward(t: Any, end_of_backward: list[Callable[[], None]], reduces: bool = True) -> None:
    """``ctx.end_of_backward`` (given) for the backward that starts on ``t`` (called by the session): a
    pre-hook on the graph's root (the first node the engine runs) queues them, so they run at the graph's
    end before anything queued later (DDP's reducer queues its finalisation when its last bucket is ready).
    One hook a backward, removed when it has run; a root without a graph (no grad_fn) has no backward to
    watch. ``reduces``: false for a backward under ``no_sync()``, for which the calls that want only the
    syncing backward (``syncing_only``) are not queued (no hook at all when that is every call: a micro-batch
    of an accumulation pays nothing here)."""
    calls = [c for c in end_of_backward if reduces or not getattr(c, "syncing_only", False)]
    if not calls:
        return
    roots = t if isinstance(t, (tuple, list)) else (t,)
    fn = next((r.grad_fn for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is not None), None)
    if fn is None:
        return
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

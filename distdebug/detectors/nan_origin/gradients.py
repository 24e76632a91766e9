"""Each rank's *local* gradients before their reduction: what tells the rank a NaN started on from the
ranks an all-reduce spread it to.

Why a mechanism of its own: DDP (per-parameter hooks with ``gradient_as_bucket_view=True``; else one fused
norm at the end of the backward, shared with loss_spike through runtime.localgrads) and a hand-written
``all_reduce`` (its input checked before the call) are the two places a local gradient can be seen; DDP's
reduction itself is never touched, so the training stays bitwise the same. Device flags only."""

from __future__ import annotations

from typing import Any

import torch

from distdebug.context import RankContext
from distdebug.detectors.nan_origin.flags import finite_flag, fold_in
from distdebug.detectors.nan_origin.state import FIRST_CHECK, StateChecks
from distdebug.runtime.discovery import find_ddp, unwrap
from distdebug.runtime.localgrads import local_grad_norms


class LocalGradients(StateChecks):
    """Local gradients (DDP, hand-written all_reduce) folded into ``self.local``; the first backward also
    queues each model's first state check (state.py)."""

    def before_backward(self, ctx: RankContext) -> None:
        """Before a DDP model's first backward: a hook on each of its parameters that sees the local
        gradient once autograd has accumulated it, before DDP's reducer copies it into its bucket and
        reduces it. DDP's reduction itself (its default path, or the script's own communication hook,
        registered at any time) is never touched: the training is bitwise the same by construction."""
        for root in ctx.models:
            if id(root) not in self._first_forward_seen:
                self._first_forward_seen.add(id(root))  # ids only, never the objects
                # Parameters only: a training forward has already updated buffers (BatchNorm's running
                # statistics take in a NaN made downstream of a bad parameter); buffers are checked as a load
                # leaves them.
                self._check_state(root, FIRST_CHECK, "", buffers=False)
        for root in ctx.models:
            ddp = find_ddp(root)
            if ddp is None or id(ddp) in self._ddp_seen:
                continue
            self._ddp_seen.add(id(ddp))
            named = [(name, p) for name, p in unwrap(ddp)[0].named_parameters() if p.requires_grad]
            if getattr(ddp, "gradient_as_bucket_view", True):
                # The gradients are views of DDP's buckets, reduced in place as each bucket is ready: only
                # a hook per parameter sees them before that.
                for name, p in named:
                    self.hook(p, "post_accumulate_grad", self._local_grad_hook((name,)))
            else:
                # DDP's default: the reducer reduces copies in its buckets and copies the results back into
                # .grad when it finalises, at the end of the backward. Until then .grad is this rank's own:
                # one fused norm of them all when the graph is done, shared with loss_spike
                # (runtime.localgrads), in place of a Python hook and a kernel per parameter.
                shared = local_grad_norms(ctx, ddp)
                listener = self.guarded(self._local_norms)
                shared.listeners.append(listener)
                self._readers.append((shared, listener))
            self.local_source = "ddp"

    def _local_grad_hook(self, key: tuple[str, ...]) -> Any:
        local = self

        def hook(param: torch.Tensor) -> None:
            g = param.grad
            if g is not None and g.layout == torch.strided:
                fold_in(local.local, key, finite_flag(g.detach()))
        return hook

    def _local_norms(self, key: tuple[str, ...], norms: torch.Tensor) -> None:
        """At the end of a syncing backward, before DDP copies the reduced gradients back: the norm of each
        local gradient (runtime.localgrads), folded in under the tuple of their names. A NaN or Inf gives a
        non-finite norm; so may a finite gradient past ~1e19, which the rare path tells apart (on_step)."""
        fold_in(self.local, key, norms)

    def _all_reduce_wrapper(self, current: Any) -> Any:
        det = self

        def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                name = det._grad_name(tensor)
                fold_in(det.local, (name,), finite_flag(tensor.detach()))
            return current(tensor, *args, **kwargs)

        return all_reduce

    def _grad_name(self, t: torch.Tensor) -> str:
        ptr = t.data_ptr()
        if ptr not in self.grad_ptrs:
            self.grad_ptrs = {p.grad.data_ptr(): n for n, p in self.params if p.grad is not None}
        name = self.grad_ptrs.get(ptr)
        return name or f"a flattened gradient buffer {tuple(t.shape)} (all_reduce)"

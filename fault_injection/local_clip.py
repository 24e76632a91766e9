"""local_clip: from its step on, each rank clips its own gradients by their own norm before they are averaged: what a
hand-written data-parallel loop that calls ``clip_grad_norm_`` before its all-reduce computes (and, on shards, a
clip whose norm is each rank's shard's: FSDP1's flat parameters under torch's clip). A rank's gradient is noisier
than the average, so its norm is larger: a threshold that the whole batch's gradient stays under clips at N ranks.

How: each rank's gradients are taken as backward computes them (a tensor hook on each parameter, before DDP's
reduction writes the average), summed over the step's backward calls (micro-batches included); before the
optimizer's step (a step pre-hook: after the last backward and its reduction, on every rank alike),
``torch.nn.utils.clip_grad_norm_`` clips them by their own norm (the call a script makes: what ``--parity``
records), and their average over the ranks (an all-reduce of this fault's own, over every rank, of every watched
parameter: a gradient a rank lacks counts as zeros) replaces the gradients DDP averaged. The threshold
(``max_norm``; 0: the averaged gradients' norm at the fault's first step, kept on the device: the global clip would
not act there, every rank's own norm above it does); an explicit ``max_norm`` is checked once, at the fault's first
step (one read of the device: a fault injected on purpose), and a threshold no rank's norm exceeds is said not to
act. Every rank acts (``rank`` must be -1): the all-reduce needs them all.
"""

from __future__ import annotations

from typing import Any

from distdebug.context import RankContext

from ._targets import inner
from .base import STEP, Param
from .parity_base import EVERY_RANK, ParityFault


class LocalClip(ParityFault):
    name = "local_clip"
    description = "gradients clipped by each rank's own norm from its step (before the reduction), not the global"
    max_norm: float
    params = (EVERY_RANK, STEP, Param("max_norm", float, 0.0,
                                      "the clipping threshold (0: the averaged gradients' norm at the fault's step)"))
    cause = "clipping"
    acts_through = "the gradients backward computes for the model's parameters from the fault's step on"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.watched: list[tuple[str, Any]] = []
        self.local: dict[int, Any] = {}
        """Parameter index -> its gradient on this rank, as backward computed it (summed over the step's calls)."""
        self.threshold: Any = None

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        if self.rank != -1:
            self.not_acted("it acts on every rank (rank=-1): its average over the ranks needs each rank's gradients")
            return
        model = inner(ctx)
        if model is None:
            self.not_acted("no model was found: no gradient to clip")
            return
        lay = ctx.layout
        if ctx.identity.world_size < 2 or (lay is not None and lay.data_group() is not None):
            # its own all-reduce runs over every rank: a data-parallel group that is part of the world (tensor or
            # pipeline parallelism beside it) would need a group the script made
            self.not_acted("the ranks are not all one data-parallel group (or there is one rank): its average over "
                           "every rank is not the script's")
            return
        watched = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if type(p).__name__ == "DTensor" or hasattr(p, "ds_id") or getattr(p, "_st_info", None) is not None:
                self.not_acted(f"{name} is sharded: each rank's gradient is a part, not a replica")
                return
            watched.append((name, p))
        self.watched = watched
        for i, (_, p) in enumerate(self.watched):
            p.register_hook(self.guarded(lambda grad, i=i: self._keep(i, grad)))
        self.pre_step(ctx, self._clip_locally)

    def _keep(self, i: int, grad: Any) -> None:
        if self.watched and self.current >= self.step:
            g = grad.detach().clone()
            self.local[i] = g if i not in self.local else self.local[i] + g

    def _clip_locally(self, optimizer: Any) -> None:
        """Before the step, on every rank: each rank's own gradients clipped by their own norm, their average the
        step's gradients. The same all-reduce on every rank (every watched parameter, zeros where a rank has no
        gradient), whatever each rank's backward reached."""
        import torch
        import torch.distributed as dist

        if not self.watched:
            return
        with torch.no_grad():
            grads = [p.grad for _, p in self.watched]
            if self.threshold is None:
                if self.max_norm > 0:
                    self.threshold = self.max_norm
                else:  # the averaged gradients' norm: the global clip would not act at this step
                    norms = [torch.linalg.vector_norm(g) for g in grads if g is not None]
                    self.threshold = torch.linalg.vector_norm(torch.stack(norms)) if norms else 0.0
            stand_ins = []
            for i, (_, p) in enumerate(self.watched):
                s = torch.empty_like(p, memory_format=torch.contiguous_format)
                g = self.local.get(i)
                s.grad = g.clone() if g is not None else torch.zeros_like(s)  # the sum so far stays as it is
                stand_ins.append(s)
        # the script's own call, on this rank's gradients (what --parity records of a clip); scales them in place
        total = torch.nn.utils.clip_grad_norm_(stand_ins, self.threshold)
        with torch.no_grad():
            flat = torch.cat([s.grad.reshape(-1) for s in stand_ins if s.grad is not None])
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            at = 0
            for _, p in self.watched:
                n = p.numel()
                value = flat[at:at + n].view_as(p)
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
                at += n
        self.local = {}
        if self.acted:
            return
        if self.max_norm > 0:  # whether any rank's own norm exceeded it: once, at the fault's first step (one read)
            top = total.detach().reshape(1).to(torch.float64).clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            if float(top) <= self.max_norm:
                self.not_acted(f"no rank's own gradient norm exceeded max_norm {self.max_norm} at step "
                               f"{self.current}: nothing was clipped (a smaller max_norm, or 0: the averaged norm)")
                self.watched = []  # nothing more: the hooks see no parameter, the step hook no gradient to clip
                return
        self.injected(max_norm=self.max_norm or "the averaged gradients' norm at this step")

    def on_step(self, event: Any) -> tuple[()]:
        self.local = {}
        return super().on_step(event)

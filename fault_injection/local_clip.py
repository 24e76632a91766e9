"""local_clip: from its step on, each rank clips its own gradients by their own norm before they are averaged: what a
hand-written data-parallel loop that calls ``clip_grad_norm_`` before its all-reduce computes (and, on shards, a
clip whose norm is each rank's shard's: FSDP1's flat parameters under torch's clip). A rank's gradient is noisier
than the average, so its norm is larger: a threshold that the whole batch's gradient stays under clips at N ranks.

How: each rank's gradients are taken as backward computes them (a tensor hook on each parameter, before DDP's
reduction writes the average), summed over the step's backward calls; after each backward (its reduction done),
``torch.nn.utils.clip_grad_norm_`` clips them by their own norm (the call a script makes: what ``--parity``
records), and their average over the ranks (an all-reduce of this fault's own, over every rank) replaces the
gradients DDP averaged. The threshold (``max_norm``; 0: the reduced gradients' norm at the fault's first step,
kept on the device) is one the reference's gradient stays under at that step, so only the ranks' own norms clip.
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
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if type(p).__name__ == "DTensor" or hasattr(p, "ds_id") or getattr(p, "_st_info", None) is not None:
                self.not_acted(f"{name} is sharded: each rank's gradient is a part, not a replica")
                self.watched = []
                return
            self.watched.append((name, p))
        for i, (_, p) in enumerate(self.watched):
            p.register_hook(self.guarded(lambda grad, i=i: self._keep(i, grad)))

    def _keep(self, i: int, grad: Any) -> None:
        if self.mine() and self.current >= self.step:
            g = grad.detach().clone()
            self.local[i] = g if i not in self.local else self.local[i] + g

    def after_backward(self) -> None:
        if not self.watched or not self.local:
            return
        import torch
        import torch.distributed as dist

        have = [(i, p) for i, (_, p) in enumerate(self.watched) if p.grad is not None and i in self.local]
        if not have:
            return
        with torch.no_grad():
            if self.threshold is None:  # the averaged gradients' norm: the global clip would not act at this step
                self.threshold = self.max_norm if self.max_norm > 0 else torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(p.grad) for _, p in have]))
            stand_ins = []
            for i, _ in have:
                s = torch.empty_like(self.local[i])
                s.grad = self.local[i].clone()  # the sum so far stays unscaled: a later backward adds to it
                stand_ins.append(s)
        # the script's own call, on this rank's gradients (what --parity records of a clip); scales them in place
        torch.nn.utils.clip_grad_norm_(stand_ins, self.threshold)
        with torch.no_grad():
            flat = torch.cat([s.grad.reshape(-1) for s in stand_ins if s.grad is not None])
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            at = 0
            for _, p in have:
                n = p.grad.numel()
                p.grad.copy_(flat[at:at + n].view_as(p.grad))
                at += n
        if not self.acted:
            self.injected(max_norm=self.max_norm or "the averaged gradients' norm at this step")

    def on_step(self, event: Any) -> tuple[()]:
        self.local = {}
        return super().on_step(event)

"""grad_summed: every gradient multiplied by the data-parallel size from its step on, on every rank: what a script
that all-reduces with SUM and never divides computes, or one whose loss is normalised by each rank's own count of
items when the reduction then sums (Megatron-LM#7452's 14/3 instead of 4 is a case of a count taken per rank).
Applied as backward computes each gradient (a tensor hook on each parameter, before its accumulation and before
DDP reduces it): as if the loss were N times larger, so that what the script does after backward (a loss
scaler's unscale, clipping) sees what it would see with the real bug."""

from __future__ import annotations

from typing import Any

from distdebug.context import RankContext

from .base import STEP
from .parity_base import EVERY_RANK, ParityFault


class GradSummed(ParityFault):
    name = "grad_summed"
    description = "every gradient times the data-parallel size from its step (summed over the ranks, not averaged)"
    params = (EVERY_RANK, STEP)
    cause = "gradient_scale"
    acts_through = "the gradients backward computes for the model's parameters from the fault's step on"
    factor = 1

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        from ._targets import inner

        model = inner(ctx)
        if model is None:
            self.not_acted("no model was found: no gradient to scale")
            return
        # the ranks a SUM would add up: the data-parallel group (tensor- or pipeline-parallel peers hold other
        # parts or other layers, never a copy to add)
        group = ctx.layout.data_group() if ctx.layout is not None else None
        self.factor = ctx.identity.world_size if group is None else len(group) if group else 1
        if self.factor == 1:
            self.not_acted("no other rank shares this rank's data-parallel group: a sum over it is its average")
            return
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.register_hook(self.guarded(self._scale))

    def _scale(self, grad: Any) -> Any:
        if not self.mine() or self.current < self.step or self.ctx is None:
            return None
        if not self.acted:
            self.injected(factor=self.factor)
        return grad * self.factor

"""lr_scaled: the learning rate multiplied by the world size at its step, on every rank: the "linear scaling
rule" applied where the global batch did not grow (the script scales its learning rate by the number of ranks
while each rank's batch shrinks to keep the global batch). The gradients stay the reference's; the update
differs. Applied in the optimizer's step pre-hook from its step on, to every parameter group whose learning rate
is a number (again after a scheduler sets it anew)."""

from __future__ import annotations

from typing import Any

from distdebug.context import RankContext

from .base import STEP
from .parity_base import EVERY_RANK, ParityFault


class LrScaled(ParityFault):
    name = "lr_scaled"
    description = "the learning rate times the world size from its step (scaled for a global batch that did not grow)"
    params = (EVERY_RANK, STEP)
    cause = "hyperparameter"
    acts_through = "a torch optimizer's step() in the fault's step, before which its learning rate is scaled"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.written: dict[int, float] = {}
        """Each group's learning rate as this fault last wrote it (a scheduler that rewrites it is scaled again)."""

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        self.pre_step(ctx, self._scale)

    def _scale(self, optimizer: Any) -> None:
        """Before each step from the fault's: every group's learning rate the world size times what the script
        (or its scheduler, which recomputes it from its own base) last set it to."""
        world = self.ctx.identity.world_size if self.ctx is not None else 1
        scaled = 0
        for group in optimizer.param_groups:
            lr = group.get("lr")
            if not isinstance(lr, (int, float)) or isinstance(lr, bool):
                continue  # a tensor learning rate (capturable, fused): reading it would stall the host
            if self.written.get(id(group)) != lr:  # the script's own value, not the one written here
                group["lr"] = lr * world
                self.written[id(group)] = group["lr"]
            scaled += 1
        if scaled and not self.acted:
            self.injected(factor=world)
        elif not scaled:
            self.not_acted("the optimizer's learning rates are tensors (capturable or fused): not scaled")

    def first_quantity(self, injected: list[dict[str, Any]]) -> str:
        return "param"  # the gradients of its step agree; the parameters after its update do not

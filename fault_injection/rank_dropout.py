"""rank_dropout: from its step on, a module's output goes through dropout drawn per rank (each rank's own
generator): the forward computes otherwise on N ranks than on 1 with the same parameters and data, as dropout
masks drawn per rank, or any randomness that depends on the rank, make it. A forward hook, in training forwards
only."""

from __future__ import annotations

from typing import Any

from distdebug.context import RankContext

from ._targets import first_float, module
from .base import MODULE, STEP
from .parity_base import EVERY_RANK, ParityFault


class RankDropout(ParityFault):
    name = "rank_dropout"
    description = "a module's output through dropout drawn per rank from its step (randomness per rank)"
    module: str
    params = (EVERY_RANK, STEP, MODULE)
    cause = "forward"
    acts_through = "a training forward of a module with parameters"
    name_of = ""

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        found = module(ctx, self.module)
        if found is None:
            self.not_acted(f"the model has no module named {self.module}" if self.module
                           else "the model has no module with parameters")
            return
        self.acts_through = f"a training forward of {found[0]} from step {self.step}"
        self.name_of = found[0]
        found[1].register_forward_hook(self.guarded(self._drop))

    def _drop(self, mod: Any, args: Any, out: Any) -> Any:
        import torch

        t = first_float(out)
        if t is None or not mod.training or self.current < self.step or self.ctx is None or not self.mine():
            return None
        g = torch.Generator(device=t.device).manual_seed(7919 * (self.ctx.rank + 1) + self.current)
        keep = (torch.rand(t.shape, generator=g, device=t.device) >= 0.5).to(t.dtype) * 2.0
        if not self.acted:
            self.injected(module=self.name_of)
        dropped = t * keep
        return (dropped, *out[1:]) if isinstance(out, tuple) else dropped

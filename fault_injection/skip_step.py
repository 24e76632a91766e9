"""skip_step: one rank skips optimizer.step once (a conditional step, an overflow check that
disagrees across ranks): its replica falls one update behind and stays behind.
"""

from __future__ import annotations

from typing import Any

from distdebug.context import RankContext
from fault_injection.base import Expect, Fault


class SkipStep(Fault):
    name = "skip_step"
    description = "one rank skips optimizer.step once"
    catcher = "replica_divergence"
    engines = ("ddp", "manual")

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        if not ctx.optimizers or not self.mine():
            return
        opt = ctx.optimizers[0]
        original = opt.step
        fault = self

        def step(*args: Any, **kwargs: Any) -> Any:
            if fault.here():
                fault.injected(optimizer=type(opt).__name__)
                fault.current += 1  # the boundary this rank skips: the next step is the fault's step + 1
                # A closure (LBFGS, Lightning's training step) is the forward and backward: it runs, as the
                # framework requires (Lightning raises when it did not), and only the update is skipped.
                closure = kwargs.get("closure", args[0] if args else None)
                if callable(closure):
                    import torch

                    with torch.enable_grad():
                        return closure()
                return None
            return original(*args, **kwargs)

        ctx.patch(opt, "step", step)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        # Two ranks: which one skipped and which one stepped twice cannot be told apart; both are named.
        return [Expect("replica_divergence", ranks=[i["rank"]] if world > 2 else list(range(world)), step=i["step"],
                       subject="optimizer step count") for i in injected]

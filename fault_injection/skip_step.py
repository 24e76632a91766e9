"""skip_step: one rank skips optimizer.step once (a conditional step, an overflow check that
disagrees across ranks): its replica falls one update behind and stays behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext

from .base import Expect, Fault

if TYPE_CHECKING:
    from .facts import Facts


class SkipStep(Fault):
    name = "skip_step"
    description = "one rank skips optimizer.step once"
    catcher = "replica_divergence"
    engines = ("ddp", "manual")

    acts_through = "the first optimizer's step(), called by the script in its step"

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        if not self.mine():
            return
        if not ctx.optimizers:
            self.not_acted("no optimizer was found: no step to skip")
            return
        opt = ctx.optimizers[0]
        self.acts_through = f"{type(opt).__name__}.step() in step {self.step}: the script did not call it then"
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

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.optimizers:
            return "no optimizer was found: no step to skip"
        if facts.replicas < 2:
            return "no two ranks hold the same parameters: nothing to compare a skipped step with"
        if not facts.wrappers <= {"ddp", "manual", "plain"}:
            return f"replayed under DDP and hand-written loops; this script uses {facts.wrapper_names}"
        return super().applicable(facts)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        # Two ranks: which one skipped and which one stepped twice cannot be told apart; both are named.
        return [Expect("replica_divergence", ranks=[i["rank"]] if world > 2 else list(range(world)), step=i["step"],
                       subject="optimizer step count") for i in injected]

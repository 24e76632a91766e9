"""nan_grad: one rank's local gradient of one parameter becomes NaN in one step, before any all-reduce.

The case nan_origin exists for: after the reduction every rank holds the NaN; only the local
gradient shows where it started. Acts through a tensor hook on the parameter, which runs before
DDP's reducer (or a hand-written all_reduce) sees the gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext

from ._targets import parameter
from .base import RANK, STEP, Expect, Fault, Param

if TYPE_CHECKING:
    from .facts import Facts


class NanGrad(Fault):
    name = "nan_grad"
    description = "one rank's local gradient of one parameter is NaN in one step (before all-reduce)"
    param: str
    params = (RANK, STEP, Param("param", str, "", "parameter name (default: the last weight)"))
    aims = (0, "param")
    catcher = "nan_origin"
    engines = ("ddp", "manual")

    acts_through = "the gradient, computed in its step, of a parameter of the model found"

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        if not self.mine():
            return
        found = parameter(ctx, self.param)
        if found is None:
            self.not_acted("no model was found: no gradient to plant a NaN in" if not ctx.models
                           else f"the model has no parameter named {self.param}" if self.param
                           else "the model has no parameter that requires a gradient")
            return
        name, p = found
        if not getattr(p, "requires_grad", False):
            self.not_acted(f"{name} does not require a gradient: there is none to plant a NaN in")
            return
        self.acts_through = f"the gradient of {name} in step {self.step}: no backward of that step reached it"

        def hook(grad: Any) -> Any:
            if self.here():
                self.injected(param=name)
                return grad * float("nan")
            return grad

        p.register_hook(hook)

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.optimizers or not facts.param:
            return "no model and optimizer were found: no gradient to plant a NaN in"
        if not facts.wrappers <= {"ddp", "manual", "plain"}:
            return (f"replayed under DDP and hand-written loops; this script uses {facts.wrapper_names} "
                    "(nan_activation covers it)")
        if facts.tensor_parallel:
            return ("a NaN born in a tensor-parallel backward reaches the TP peers through its all-reduce before any "
                    "hook can tell who made it (a known limit; nan_activation covers the forward)")
        return super().applicable(facts)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        return [Expect("nan_origin", ranks=[i["rank"]], step=i["step"], subject=i["param"]) for i in injected]

"""unreduced_grad: one parameter keeps each rank's own gradient from its step on: what a parameter outside the
data-parallel wrapper, or a hand-written all-reduce that misses it, leaves. The local gradient is taken as
backward computes it (a tensor hook on the parameter, before DDP's reduction writes the average) and summed over
the step's backward calls; after each backward (its reduction done), it replaces the averaged one, before
anything the script does next (a loss scaler's unscale, clipping) sees it."""

from __future__ import annotations

from typing import Any

from distdebug.context import RankContext, StepEvent

from ._targets import parameter
from .base import STEP, Param
from .parity_base import EVERY_RANK, ParityFault


class UnreducedGrad(ParityFault):
    name = "unreduced_grad"
    description = "one parameter keeps each rank's own gradient from its step (never averaged over the ranks)"
    param: str
    params = (EVERY_RANK, STEP, Param("param", str, "", "parameter name (default: the last weight)"))
    cause = "unreduced"
    acts_through = "a plain (not sharded) parameter whose gradient backward computes"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.target: tuple[str, Any] | None = None
        self.local: Any = None

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        found = parameter(ctx, self.param)
        if found is None:
            self.not_acted(f"the model has no parameter named {self.param}" if self.param
                           else "the model has no parameter that requires a gradient")
            return
        name, p = found
        if type(p).__name__ == "DTensor" or hasattr(p, "ds_id") or getattr(p, "_st_info", None) is not None:
            self.not_acted(f"{name} is sharded: each rank's gradient is a part, not a replica")
            return
        lay = ctx.layout
        if lay is not None and lay.data_group() is False:
            self.not_acted(f"no other rank shares {name}'s data-parallel group (layout: {lay.label()}): its "
                           "gradient is the only one, reduced or not")
            return
        self.target = found
        self.acts_through = f"{name}'s gradient in backward from step {self.step}"
        p.register_hook(self.guarded(self._keep))

    def _keep(self, grad: Any) -> None:
        if self.mine() and self.current >= self.step:
            g = grad.detach().clone()
            self.local = g if self.local is None else self.local + g

    def after_backward(self) -> None:
        if self.target is None or self.local is None:
            return
        import torch

        name, p = self.target
        if p.grad is None:
            return
        with torch.no_grad():
            p.grad.copy_(self.local)
        if not self.acted:
            self.injected(param=name)

    def on_step(self, event: StepEvent) -> tuple[()]:
        self.local = None
        return super().on_step(event)

    def first_quantity(self, injected: list[dict[str, Any]]) -> str:
        return next((f"grad:{i['param']}" for i in injected if i.get("param")), "grad")

"""hang: one rank stops in the middle of a step and never reaches its next collective, so every
other rank waits in the gradient all-reduce (until torch's collective timeout: 30 minutes for gloo by default).

The hang diagnosis (launcher side, after --stall-timeout) must name that rank and that step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext

from .base import Expect, Fault

if TYPE_CHECKING:
    from .facts import Facts


class Hang(Fault):
    name = "hang"
    description = "one rank blocks in its forward at one step and never joins the next collective"
    catcher = "hang"
    engines = ("ddp", "manual", "ddp_tp")  # DDP x TP: the blocked rank's TP peer waits in a functional collective
    attach_args = ("--stall-timeout", "4", "--startup-timeout", "60")  # a hang asked for at step 1 is a start-up one
    exit_codes = (124,)

    acts_through = "the model's forward, called in its step"

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        if not self.mine():
            return
        if not ctx.models:
            self.not_acted("no model was found: no forward to block in")
            return
        ctx.models[0].register_forward_pre_hook(self._pre)
        self.acts_through = f"the model's forward in step {self.step}: it did not run then"

    def _pre(self, module: Any, args: Any) -> None:
        if self.here():
            self.injected(where="forward")
            while True:  # stuck until the job is ended
                time.sleep(3600)

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.module and not facts.param:
            return "no model was found: no forward to block in"
        if not (facts.collectives or facts.pipeline or facts.tensor_parallel
                or facts.wrappers & {"ddp", "fsdp2", "deepspeed", "manual"}):
            return "no collective or pipeline send/recv was seen: no rank would wait for the blocked one"
        return super().applicable(facts)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        return [Expect("hang", ranks=[i["rank"]], step=i["step"]) for i in injected]

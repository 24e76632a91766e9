"""straggler: one rank is slower in every step from ``step`` on (a throttled GPU, a noisy neighbour).

Every other rank then waits for it in each all-reduce. The straggler detector must name it, and say
that it computes slower (its data loader is not the cause). It sleeps once per step, in the step's
first forward (under gradient accumulation the rank is then late at the reduction of the step's last
micro-batch, as a slow GPU is), for as long as ``Pace`` says: ``delay`` or its own time per step,
whichever is longer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext

from .base import FACTOR, RANK, STEP, Expect, Param, SlowRank

if TYPE_CHECKING:
    from .facts import Facts


class Straggler(SlowRank):
    name = "straggler"
    description = ("one rank sleeps in its first forward of every step from `step` on: `delay` seconds, or `factor` "
                   "times its own time per step where that is longer")
    params = (RANK, STEP, Param("delay", float, 0.05, "seconds added to each of its steps (at least)"), FACTOR)
    catcher = "straggler"
    continuing = True
    steps = 20  # the straggler scores need medians over 8 steps every rank reported

    acts_through = "the model's forward, called from its step on"

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        if not self.mine():
            return
        if not ctx.models:
            self.not_acted("no model was found: no forward to slow down")
            return
        ctx.models[0].register_forward_pre_hook(self._pre)

    def _pre(self, module: Any, args: Any) -> None:
        if self.current >= self.step and self.mine():
            self.lag()

    needs = 17  # the scores need medians over 8 steps every rank reported: found 13-15 steps after it starts

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.module and not facts.param:
            return "no model was found: no forward to slow down"
        return super().applicable(facts)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        return [Expect("straggler", ranks=[i["rank"]], subject="compute") for i in injected[:1]]

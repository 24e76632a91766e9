"""seed_mismatch: every rank seeds torch differently (``torch.manual_seed(s)`` becomes ``s + rank``),
so the initial parameters differ per rank. In a hand-written loop the replicas diverge from step 0
(an error). Under DDP the constructor's broadcast makes the parameters equal: there it is no fault
(per-rank seeds are a common idiom, and init_seed rightly says nothing), so it is not replayed there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext

from .base import Expect, Fault

if TYPE_CHECKING:
    from .facts import Facts


class SeedMismatch(Fault):
    name = "seed_mismatch"
    description = "torch.manual_seed(s) becomes manual_seed(s + rank): a different init on every rank"
    params = ()
    catcher = "init_seed"
    engines = ("manual",)

    acts_through = "a torch.manual_seed call of the script's: it made none"

    def setup(self, ctx: RankContext) -> None:
        super().setup(ctx)
        import torch

        original = torch.manual_seed
        fault = self

        def manual_seed(seed: Any) -> Any:
            if not fault.acted:
                fault.injected(seed=int(seed), became=int(seed) + ctx.rank)
            return original(int(seed) + ctx.rank)

        ctx.patch(torch, "manual_seed", manual_seed)
        ctx.patch(torch.random, "manual_seed", manual_seed)

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.manual_seed:
            return "torch.manual_seed is not called before the first step"
        if not facts.hand_written:
            return (f"{facts.wrapper_names} makes the initial parameters equal (or shards them): per-rank "
                    "seeds are no fault there")
        if facts.replicas < 2:
            return "no two ranks hold the same parameters: nothing to compare"
        return super().applicable(facts)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        return [Expect("init_seed", step=0)] if injected else []

"""slow_dataloader: one rank's DataLoader is slow (a slow disk, too few workers): the rank is slow
because it waits for data, not because it computes slowly. The straggler detector must name it and
blame its data loader. It sleeps once per step, in the step's first batch, for as long as ``Pace``
says: ``delay`` or its own time per step, whichever is longer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext

from .base import FACTOR, RANK, Expect, Param, SlowRank

if TYPE_CHECKING:
    from .facts import Facts


class SlowDataloader(SlowRank):
    name = "slow_dataloader"
    description = ("one rank's DataLoader sleeps before the first batch of every step: `delay` seconds, or `factor` "
                   "times its own time per step where that is longer")
    params = (RANK, Param("delay", float, 0.05, "seconds added to each step's batches (at least)"), FACTOR)
    catcher = "straggler"
    steps = 20  # the straggler scores need medians over 8 steps every rank reported

    acts_through = "a torch DataLoader iterated on its rank"

    def setup(self, ctx: RankContext) -> None:
        super().setup(ctx)
        if not self.mine():
            return
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        original = _BaseDataLoaderIter.__next__
        fault = self

        def __next__(it: Any) -> Any:
            fault.lag()
            return original(it)

        ctx.patch(_BaseDataLoaderIter, "__next__", __next__)

    needs = 20  # the scores need medians over 8 steps every rank reported

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.dataloader:
            return "no DataLoader: the script makes its batches itself"
        return super().applicable(facts)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        return [Expect("straggler", ranks=[i["rank"]], subject="data loader", evidence={"cause": "data loader"})
                for i in injected[:1]]

"""slow_dataloader: one rank's DataLoader takes `delay` seconds longer for every batch (a slow disk,
too few workers): the rank is slow because it waits for data, not because it computes slowly.
The straggler detector must name it and blame its data loader.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext
from fault_injection.base import RANK, Expect, Fault, Param

if TYPE_CHECKING:
    from fault_injection.probe import Facts


class SlowDataloader(Fault):
    name = "slow_dataloader"
    description = "one rank's DataLoader sleeps `delay` seconds before every batch"
    delay: float
    params = (RANK, Param("delay", float, 0.05, "seconds added to each batch"))
    catcher = "straggler"
    steps = 20  # the straggler scores need medians over 8 steps every rank reported

    def setup(self, ctx: RankContext) -> None:
        super().setup(ctx)
        if not self.mine():
            return
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        original = _BaseDataLoaderIter.__next__
        fault = self

        def __next__(it: Any) -> Any:
            if not fault.acted:
                fault.injected(delay=fault.delay)
            time.sleep(fault.delay)
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

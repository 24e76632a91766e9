"""duplicate_data: every rank gets the same batches (DistributedSampler told there is one replica),
so the ranks repeat each other's work: the mistake of a missing DistributedSampler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext
from fault_injection.base import Expect, Fault

if TYPE_CHECKING:
    from fault_injection.probe import Facts


class DuplicateData(Fault):
    name = "duplicate_data"
    description = "DistributedSampler sees one replica on every rank: every rank gets the same batches"
    params = ()
    catcher = "data_order"
    engines = ("ddp",)

    def setup(self, ctx: RankContext) -> None:
        super().setup(ctx)
        from torch.utils.data.distributed import DistributedSampler

        original = DistributedSampler.__init__
        fault = self

        def init(sampler: Any, dataset: Any, *args: Any, **kwargs: Any) -> None:
            original(sampler, dataset, *args, **kwargs)
            sampler.num_replicas, sampler.rank = 1, 0
            sampler.num_samples = len(dataset)
            sampler.total_size = len(dataset)
            fault.injected(sampler="DistributedSampler")

        ctx.patch(DistributedSampler, "__init__", init)

    needs = 2  # found at step 2

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.distributed_sampler:
            return ("no DistributedSampler: " + ("the script makes its batches itself" if not facts.dataloader
                                                 else "its DataLoader shards data some other way"))
        return super().applicable(facts)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        return [Expect("data_order", ranks=list(range(world)), step=2, subject="input batches")] if injected else []

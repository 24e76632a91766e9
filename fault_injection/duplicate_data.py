"""duplicate_data: every rank gets the same batches (DistributedSampler told there is one replica),
so the ranks repeat each other's work: the mistake of a missing DistributedSampler.
"""

from __future__ import annotations

from typing import Any

from distdebug.context import RankContext
from fault_injection.base import Expect, Fault


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

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        return [Expect("data_order", ranks=list(range(world)), step=2, subject="input batches")] if injected else []

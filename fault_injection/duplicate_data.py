"""duplicate_data: every rank gets the same batches, so the ranks repeat each other's work: the mistake
of a missing DistributedSampler. It acts on what shards the data: ``DistributedSampler`` (and its
subclasses: Lightning's wrappers) is told there is one replica; accelerate's ``BatchSamplerShard``
(what ``Accelerator.prepare`` and the Hugging Face Trainer shard with) one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext

from .base import Expect, Fault, ParityExpect

if TYPE_CHECKING:
    from .facts import Facts


class DuplicateData(Fault):
    name = "duplicate_data"
    description = ("DistributedSampler (or accelerate's BatchSamplerShard) sees one replica on every rank: every "
                   "rank gets the same batches")
    params = ()
    catcher = "data_order"
    engines = ("ddp", "parity")

    _hook: Any = None

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
        from distdebug.runtime.imports import when_imported

        self._hook = when_imported("accelerate.data_loader", self._patch_accelerate)

    def _patch_accelerate(self, module: Any) -> None:
        shard = getattr(module, "BatchSamplerShard", None)
        if shard is None or self.ctx is None:
            return
        original = shard.__init__
        fault = self

        def init(sampler: Any, *args: Any, **kwargs: Any) -> None:
            original(sampler, *args, **kwargs)
            if getattr(sampler, "num_processes", 1) > 1:
                sampler.num_processes, sampler.process_index = 1, 0  # every rank iterates the whole sampler
                fault.injected(sampler="BatchSamplerShard")

        self.ctx.patch(shard, "__init__", init)

    acts_through = ("a DistributedSampler (or accelerate's BatchSamplerShard) built by the script: it built none, "
                    "or none that shards over more than one rank")

    def on_end(self) -> tuple[()]:
        if self._hook is not None:
            self._hook.remove()
        return super().on_end()  # never acted: said, in the words above

    needs = 2  # found at step 2

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.distributed_sampler:
            return ("no DistributedSampler or accelerate BatchSamplerShard: "
                    + ("the script makes its batches itself" if not facts.dataloader
                       else "its DataLoader shards data some other way"))
        unshareable = facts.unshareable_samples()
        if unshareable:  # data_order compares the batches' contents: the same indices must mean the same batch
            return unshareable
        return super().applicable(facts)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        return [Expect("data_order", ranks=list(range(world)), step=2, subject="input batches")] if injected else []

    def parity_expect(self, injected: list[dict[str, Any]]) -> ParityExpect | None:
        # on the parity recipe: the ranks' batches repeat each other's from the first step, the reference's do not
        return ParityExpect(1, "grad", "data") if injected else None

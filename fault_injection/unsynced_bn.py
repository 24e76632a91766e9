"""unsynced_bn: BatchNorm statistics left to drift apart across ranks.

``mode=buffers`` makes every DDP wrap use broadcast_buffers=False (running statistics are no
longer copied from rank 0 each forward); ``mode=sync`` makes SyncBatchNorm.convert_sync_batchnorm
return the model unchanged (plain BatchNorm where the script asked for synchronised statistics).
Both are changes made from outside the script, before it builds its model.

``mode=sync`` is found only where it shows: bn_divergence flags plain BatchNorm when the ranks' batch
statistics disagree beyond sampling (data that differs by rank); on evenly shuffled data per-rank
statistics are a legitimate choice (PyTorch's default) and no finding is expected of them. The
catalogue's default, ``mode=buffers``, is found on every run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext

from .base import Expect, Fault, Param

if TYPE_CHECKING:
    from .facts import Facts


class UnsyncedBn(Fault):
    name = "unsynced_bn"
    description = "DDP broadcast_buffers=False (mode=buffers) or SyncBatchNorm conversion skipped (mode=sync)"
    mode: str
    params = (Param("mode", str, "buffers", "buffers or sync"),)
    catcher = "bn_divergence"
    engines = ("ddp",)

    def setup(self, ctx: RankContext) -> None:
        super().setup(ctx)
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        fault = self
        self.acts_through = ("a SyncBatchNorm.convert_sync_batchnorm call of the script's: it made none"
                             if self.mode == "sync" else "a DistributedDataParallel the script builds: it built none")
        if self.mode == "sync":
            def convert(cls: Any, module: Any, *args: Any, **kwargs: Any) -> Any:
                fault.injected(mode="sync", modules=_bn_names(module))
                return module

            ctx.patch(torch.nn.SyncBatchNorm, "convert_sync_batchnorm", classmethod(convert))
            return
        original = DDP.__init__

        def init(ddp: Any, module: Any, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("forward_sync_buffers", None)
            kwargs["broadcast_buffers"] = False
            fault.injected(mode="buffers", modules=_bn_names(module))
            original(ddp, module, *args, **kwargs)

        ctx.patch(DDP, "__init__", init)

    needs = 2  # found at step 2

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.batchnorm:
            return "no BatchNorm in the model"
        if "ddp" not in facts.wrappers:
            return f"acts through DDP's broadcast_buffers; this script uses {facts.wrapper_names}"
        if facts.syncbatchnorm:
            return ("the model's SyncBatchNorm keeps statistics equal whatever DDP broadcasts (skipping the "
                    "conversion shows only on data that differs by rank)")
        if facts.broadcast_buffers is False:
            return "the script already keeps per-rank BatchNorm buffers (broadcast_buffers=False)"
        return super().applicable(facts)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        mods: list[str] = next((i["modules"] for i in injected if i.get("modules")), [])
        # Running statistics apart on every rank; compared first at step 2.
        return [Expect("bn_divergence", ranks=list(range(world)), step=2, subject=m) for m in mods[:1]]


def _bn_names(module: Any) -> list[str]:
    from torch.nn.modules.batchnorm import _BatchNorm

    return [n for n, m in module.named_modules() if isinstance(m, _BatchNorm)]

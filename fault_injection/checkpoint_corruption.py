"""checkpoint_corruption: a tensor restored by ``torch.load`` on one rank is altered (+1 on its first
element): the silent half of "loss jumps after restore". checkpoint_roundtrip must name the rank
and the tensor. Acts on the first load of the run that holds a floating-point tensor, wherever
the script (or DeepSpeed) loads from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext

from .base import Expect, Fault, Param

if TYPE_CHECKING:
    from .facts import Facts


class CheckpointCorruption(Fault):
    name = "checkpoint_corruption"
    description = "the first tensor torch.load restores on one rank is altered (+1 on one element)"
    params = (Param("rank", int, 1, "the rank it acts on"),)
    catcher = "checkpoint_roundtrip"
    engines = ("zero2_resume",)

    acts_through = "a torch.load of the script's that restores a floating-point tensor"
    loads = 0
    """torch.load calls seen on its rank."""

    def setup(self, ctx: RankContext) -> None:
        super().setup(ctx)
        if not self.mine():
            return
        import torch

        original = torch.load
        fault = self

        def load(*args: Any, **kwargs: Any) -> Any:
            obj = original(*args, **kwargs)
            fault.loads += 1
            if not fault.acted:
                hit = _alter_first(obj, "")
                if hit is not None:
                    # A restore is placed at the step it follows, as checkpoint_roundtrip places it
                    # (a load between two steps belongs to neither's forward and backward).
                    from distdebug.detectors.checkpoint_roundtrip import target

                    where = (target(args[0]) or "a buffer") if args else "?"
                    fault.injected(tensor=hit, file=where, step=fault.current - 1)
            return obj

        ctx.patch(torch, "load", load)

    def on_end(self) -> tuple[()]:
        if self.mine() and not self.acted:
            self.not_acted("no checkpoint was loaded: the script never called torch.load on this rank" if not self.loads
                           else f"the script's {self.loads} torch.load call{'s' if self.loads > 1 else ''} on this "
                                "rank restored no floating-point tensor")
        return super().on_end()

    needs = 1

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.loads:
            return ("the script restores no checkpoint it saved in the same run (torch.save/torch.load of a path, "
                    "a file object, or a buffer's bytes written to a file)")
        return super().applicable(facts)

    @classmethod
    def fit(cls, facts: Facts) -> dict[str, Any]:
        return {"rank": 1 if 1 in facts.loads else min(facts.loads)}

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        return [Expect("checkpoint_roundtrip", ranks=[i["rank"]], subject=i["tensor"]) for i in injected]


def _alter_first(obj: Any, prefix: str) -> str | None:
    import torch

    if isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.numel():
        with torch.no_grad():
            obj.view(-1)[0] += 1.0
        return prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        hit = _alter_first(value, f"{prefix}.{key}" if prefix else str(key))
        if hit is not None:
            return hit
    return None

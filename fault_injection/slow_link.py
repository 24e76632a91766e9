"""slow_link: point-to-point traffic between one pair of ranks is slowed (a bad cable, a PCIe link
through the CPU between two cards). Only a pairwise link matrix shows it
(``distdebug doctor --bandwidth``): the replay runs the doctor's worker with 3 ranks and expects the
pair named.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext

from .base import Expect, Fault, Param

if TYPE_CHECKING:
    from .facts import Facts


class SlowLink(Fault):
    name = "slow_link"
    description = "send/recv between ranks `a` and `b` take `delay` seconds longer"
    a: int
    b: int
    delay: float
    params = (Param("a", int, 0, "one end"), Param("b", int, 1, "the other end"),
              Param("delay", float, 0.05, "seconds added to each send/recv between them (50 ms: well above the "
                    "scheduling noise of a loaded CPU host, so the pair stands out from every other link)"))
    catcher = "link_matrix"
    engines = ("doctor",)
    min_world = 3  # a slow pair is told from the median link only among several

    def targets(self) -> list[int]:
        return [self.a, self.b]

    def mine(self) -> bool:
        return self.ctx is not None and self.ctx.rank in (self.a, self.b)

    def setup(self, ctx: RankContext) -> None:
        super().setup(ctx)
        self.acts_through = f"a torch.distributed send or recv between ranks {self.a} and {self.b}: none was made"
        if ctx.rank not in (self.a, self.b):
            return
        import torch.distributed as dist

        peer = self.b if ctx.rank == self.a else self.a
        fault = self
        for fn in ("send", "recv", "isend", "irecv"):
            original = getattr(dist, fn)

            def slowed(tensor: Any, other: Any = None, *args: Any, _orig: Any = original, **kwargs: Any) -> Any:
                if other == peer:
                    if not fault.acted:
                        fault.injected(pair=[fault.a, fault.b], delay=fault.delay)
                    time.sleep(fault.delay)
                return _orig(tensor, other, *args, **kwargs)

            ctx.patch(dist, fn, slowed)

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        return "acts on distdebug doctor --bandwidth's link matrix (replayed on the doctor's worker), not on a script"

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        a, b = sorted((self.a, self.b))
        return [Expect("link_matrix", ranks=[a, b], subject=f"link {a}-{b}")] if injected else []

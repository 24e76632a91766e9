"""bitflip_param: one bit of one parameter element flips on one rank (silent data corruption).

No NaN, no error: the replica simply differs from the others from that step on, which only a
cross-rank comparison of the parameters (replica_divergence) can see. The bit flips as the step's
forward starts (after the previous step's checks), so that step's boundary is the first to differ.
"""

from __future__ import annotations

from typing import Any

from distdebug.context import RankContext
from fault_injection._targets import parameter
from fault_injection.base import RANK, STEP, Expect, Fault, Param


class BitflipParam(Fault):
    name = "bitflip_param"
    description = "one bit of one parameter element flips on one rank (silent data corruption)"
    param: str
    bit: int
    params = (RANK, STEP, Param("param", str, "", "parameter name (default: the last weight)"),
              Param("bit", int, 20, "bit of the first element's float32 word (0-31)"))
    catcher = "replica_divergence"
    engines = ("ddp", "manual")

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        if ctx.models and self.mine():
            ctx.models[0].register_forward_pre_hook(self._pre)

    def _pre(self, module: Any, args: Any) -> None:
        if not self.here():
            return
        import torch

        found = parameter(self.ctx, self.param) if self.ctx is not None else None
        if found is not None and found[1].dtype == torch.float32:
            name, p = found
            with torch.no_grad():
                p.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << self.bit)
            self.injected(param=name, bit=self.bit)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        # With two ranks nobody can say which one is right: both are named.
        return [Expect("replica_divergence", ranks=[i["rank"]] if world > 2 else list(range(world)),
                       step=i["step"], subject=i["param"]) for i in injected]

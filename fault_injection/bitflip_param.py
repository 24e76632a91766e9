"""bitflip_param: one bit of one parameter element flips on one rank (silent data corruption).

No NaN, no error: the replica simply differs from the others from that step on, which only a
cross-rank comparison of the parameters (replica_divergence) can see. The bit flips right after the
step's optimizer update (a per-optimizer post-hook, which runs before the session's global one that
ends the step), so that step's boundary is the first to differ. Flipping then, rather than as the
forward starts, hits the tensor the optimizer keeps: under FSDP2 the forward runs on a gathered copy
that is freed after it, and a flip there would be averaged away.

In a layout where ranks are not all replicas (tensor parallel, 2-D meshes), the flip is recorded with
its tensor's replica group (the ranks that hold the same shard), which is where it must be found.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext

from ._targets import local, parameter
from .base import RANK, STEP, Expect, Fault, Param

if TYPE_CHECKING:
    from .probe import Facts


class BitflipParam(Fault):
    name = "bitflip_param"
    description = "one bit of one parameter element flips on one rank (silent data corruption)"
    param: str
    bit: int
    params = (RANK, STEP, Param("param", str, "", "parameter name (default: the last weight)"),
              Param("bit", int, 20, "bit of the first element's float32 word (0-31)"))
    aims = (0, "param")
    catcher = "replica_divergence"
    engines = ("ddp", "manual", "ddp_tp", "hsdp_tp", "pp_dp")
    rerun_on = ("ddp", "manual")
    """Recipes whose replay also runs it under ``--rerun-on-anomaly``: the flipped rank re-executes the step
    and calls it a stored corruption (the step's computation reproduces; the stored value stays wrong)."""

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        if ctx.optimizers and self.mine():
            ctx.optimizers[0].register_step_post_hook(self._post)

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.here():
            return
        import torch

        found = parameter(self.ctx, self.param) if self.ctx is not None else None
        if found is None or found[1].dtype != torch.float32:
            return
        name, p = found
        layout = getattr(self.ctx, "layout", None)
        group = layout.replicas(p) if layout is not None else None
        if group is False:
            return  # nobody else holds this tensor: no comparison can see a flip in it
        with torch.no_grad():
            local(p).view(-1)[:1].view(torch.int32).bitwise_xor_(1 << self.bit)
        self.injected(param=name, bit=self.bit, replicas=group, rerun=_rerun_records())

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.optimizers or not facts.param:
            return "no model and optimizer were found: no parameter to flip a bit in"
        if facts.replicas < 2:
            return "no two ranks hold the same parameters: nothing to compare a flipped bit with"
        if facts.wrappers & {"fsdp2", "deepspeed"}:
            return f"not replayed under sharded parameters ({facts.wrapper_names}): each rank holds its own shard"
        return super().applicable(facts)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        # Found among the ranks that hold the same tensor (every rank unless the layout says fewer).
        # With two of them nobody can say which one is right: both are named.
        out = []
        for i in injected:
            group = i.get("replicas") or list(range(world))
            out.append(Expect("replica_divergence", ranks=[i["rank"]] if len(group) > 2 else group,
                              step=i["step"], subject=i["param"]))
            if i.get("rerun"):  # under --rerun-on-anomaly: the flipped rank says what kind of fault it was
                out.append(Expect("rerun", ranks=[i["rank"]], step=i["step"],
                                  evidence={"verdict": "stored corruption", "tensor": i["param"]}))
        return out


def _rerun_records() -> bool:
    """This rank captures its steps for re-execution (attach --rerun-on-anomaly, a model it can re-run)."""
    from distdebug.runtime.session import current_session

    session = current_session()
    return session is not None and any(d.name == "rerun" and getattr(d, "recorders", None) and not d.off
                                       for d in session.detectors)

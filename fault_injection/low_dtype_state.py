"""low_dtype_state: the optimizer's state kept in bfloat16 from its step on, on every rank: what a script that
builds its optimizer over bfloat16 parameters (AdamW's moments then follow their dtype: AReaL#1292), or casts
its state to save memory, computes. Applied once, in the optimizer's step pre-hook: each floating state tensor of
more than one element cast to bfloat16 and kept so.

Acts on optimizers whose update accepts a state of another dtype than the gradient: SGD's one-tensor-at-a-time
update (the default on the CPU); its fused and multi-tensor updates, and torch's AdamW (``lerp_`` wants one
dtype), refuse one: there the fault does not act and says so."""

from __future__ import annotations

from typing import Any

from distdebug.context import RankContext

from .base import STEP
from .parity_base import EVERY_RANK, ParityFault


class LowDtypeState(ParityFault):
    name = "low_dtype_state"
    description = "the optimizer's state cast to bfloat16 from its step (kept in a lower dtype than the parameters)"
    params = (EVERY_RANK, STEP)
    cause = "dtype"
    acts_through = "a torch.optim.SGD with momentum, whose state is cast before its step"

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        self.pre_step(ctx, self._cast)

    def _cast(self, optimizer: Any) -> None:
        if self.acted:
            return
        import torch

        if type(optimizer).__name__ != "SGD":
            self.not_acted(f"{type(optimizer).__name__}'s update takes its state in the gradient's dtype only: cast, "
                           "the training would fail (SGD's momentum is cast instead)")
            return
        on_cpu = all(p.device.type == "cpu" for g in optimizer.param_groups for p in g["params"])
        if any(g.get("fused") or g.get("foreach") or (g.get("foreach") is None and not on_cpu)
               for g in optimizer.param_groups):
            self.not_acted("the optimizer's fused or multi-tensor update wants one dtype in each list: a state cast "
                           "would fail the training (it acts on SGD's one-tensor-at-a-time update)")
            return
        cast = 0
        for st in optimizer.state.values():
            for k, v in list(st.items()):
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1 \
                        and v.dtype != torch.bfloat16:
                    st[k] = v.to(torch.bfloat16)
                    cast += 1
        if cast:
            self.injected(dtype="bfloat16", tensors=cast)
        else:
            self.not_acted("the optimizer holds no floating state to cast (SGD without momentum)")

    def first_quantity(self, injected: list[dict[str, Any]]) -> str:
        return "param"  # the gradients of its step agree; the update made with the rounded state does not

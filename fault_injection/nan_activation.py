"""nan_activation: one module's output gets a NaN on one rank in one step (a bad kernel, a log of 0).

nan_origin must name that module as the first in forward order with a non-finite output, and the
rank it started on. A forward hook registered before the detectors' replaces the output, so
every later hook (nan_origin's included) sees the poisoned tensor.

The script can keep the NaN from its loss (the element masked, replaced or left unused): at the end of
its step, where the rank's loss is known and finite, the fault says that its NaN did not reach it
(``not_acted``); where the loss is not known on that rank (a pipeline's first stage), no verdict.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

from distdebug.context import RankContext, StepEvent

from ._targets import first_float, module, with_nan
from .base import MODULE, RANK, STEP, Expect, Fault

if TYPE_CHECKING:
    from .facts import Facts


class NanActivation(Fault):
    name = "nan_activation"
    description = "one module's output on one rank holds a NaN in one step"
    module: str
    params = (RANK, STEP, MODULE)
    aims = (1, "module")
    catcher = "nan_origin"
    # FSDP2/ZeRO reduce inside: the forward names the origin. In tensor and pipeline layouts the NaN
    # reaches the other ranks through forward communication: born on one rank, received by the others.
    engines: ClassVar[tuple[str, ...]] = ("ddp", "manual", "fsdp2", "zero2", "tp", "hsdp_tp", "pp")

    acts_through = "a forward call, in its step, of a module of the model found"

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        if not self.mine():
            return
        found = module(ctx, self.module)
        if found is None:
            self.not_acted("no model was found: no module output to plant a NaN in" if not ctx.models
                           else f"the model has no module named {self.module}" if self.module
                           else "the model has no module with parameters whose output can turn non-finite (only "
                                "embeddings and normalisations, which nan_origin checks by their inputs)")
            return
        name, mod = found
        self.target = name
        self.acts_through = f"a forward call of {name} in step {self.step}: it did not run forward then"

        import torch

        def hook(m: Any, args: Any, out: Any) -> Any:
            # A forward with gradients on only: an evaluation forward in its step (no_grad) would take the NaN
            # and leave the training step's loss finite.
            if not torch.is_grad_enabled() or not self.acts_now():
                return None
            if first_float(out) is None:
                if not self.acted:
                    self.not_acted(f"{name}'s output in step {self.step} is not a floating-point tensor (nor a tuple "
                                   f"led by one: a {type(out).__name__}): no NaN can be planted in it")
                return None
            if not self.acted:
                self.injected(module=name)  # once: the step it first acted in
            self.done_in = self.execution()
            return with_nan(out)

        mod.register_forward_hook(hook)

    target = ""
    """The module it plants its NaN in (known at attach)."""

    def on_step(self, event: StepEvent) -> tuple[()]:
        """The end of its step: a NaN planted that left this rank's loss finite did not reach it. Only the step
        as it ran counts (a re-execution's loss is not the event's)."""
        if (event.step == self.step and self.acted and self.mine() and event.loss is not None
                and math.isfinite(event.loss)):
            self.not_acted(f"the NaN planted in {self.target}'s output in step {self.step} did not reach the step's "
                           f"loss ({event.loss:.6g} on this rank): the loss does not depend on that element (masked, "
                           "replaced or left unused by the script)")
        return super().on_step(event)

    done_in: tuple[int, int] | None = None  # the execution it last acted in (Fault.execution)

    def acts_now(self) -> bool:
        """Whether this forward call gets the NaN: on its rank, the module's first call in each execution of
        its step: the step as it ran, and again when the harness re-executes that step (a NaN that the
        step's inputs and code produce comes back when they are run again). transient_compute acts in the
        first execution only; persistent_compute in every execution from its step on."""
        step, _ = now = self.execution()
        return self.mine() and step == self.step and self.done_in != now

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.module:
            return ("no module whose output can turn non-finite (no model, or only embeddings, normalisations "
                    "and activations, which nan_origin checks by their inputs)")
        return super().applicable(facts)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        return [Expect("nan_origin", ranks=[i["rank"]], step=i["step"],
                       evidence={"first_nonfinite_module_output": i["module"]}) for i in injected]

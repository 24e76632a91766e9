"""loss_spike: a corrupted step: the model's output is multiplied by `factor` in one step, and gets noise
of `factor`'s size, which is what a corrupted batch does to the loss (scaling the input instead would be
undone by the first BatchNorm; scaling alone barely moves a cross-entropy whose logits are still small,
as an early classifier's are, and not at all a mean-squared error around zero). The noise is seeded by
the step: a replay is repeatable.

``rank=-1`` (the default) corrupts every rank's step: each rank's own loss spikes. One rank only
also makes that rank's loss depart from the others' (loss_spike's cross-rank check, 3+ ranks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext

from ._targets import inner
from .base import Expect, Fault, Param

if TYPE_CHECKING:
    from .probe import Facts


class LossSpike(Fault):
    name = "loss_spike"
    description = "a corrupted step: the model's output times `factor`, plus noise of that size, at one step"
    factor: float
    params = (Param("rank", int, -1, "the rank it acts on (-1: every rank)"),
              Param("step", int, 20, "the step (>= 12: the spike rule needs a history)"),
              Param("factor", float, 30.0, "the multiplier"))
    catcher = "loss_spike"
    engines = ("ddp", "fsdp2", "zero2", "manual")

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        model = inner(ctx)
        if model is not None and self.mine():
            model.register_forward_hook(self._post)

    def _post(self, module: Any, args: Any, out: Any) -> Any:
        """The output as the model returns it: a tensor; a mapping with a ``loss`` (a Hugging Face
        ``ModelOutput`` that computed its loss from ``labels``: that loss, which the script backpropagates);
        a tuple or list led by a tensor (``return_dict=False``: the loss first when there is one)."""
        import torch

        def scalable(t: Any) -> bool:
            return isinstance(t, torch.Tensor) and t.is_floating_point()

        # Every forward of the step: its micro-batches (accumulation, a pipeline's schedule) all corrupted.
        if not (self.mine() and self.current == self.step):
            return None
        if scalable(out):
            what, new = {}, self._corrupt(out)
        elif hasattr(out, "keys") and "loss" in out.keys() and scalable(out["loss"]):
            out["loss"] = out["loss"] * self.factor  # a ModelOutput keeps its attribute in step with the key
            what, new = {"output": "loss"}, out
        elif type(out) in (tuple, list) and out and scalable(out[0]):
            first = out[0] * self.factor if out[0].numel() == 1 else self._corrupt(out[0])  # a loss, or logits
            what, new = {"output": "first"}, type(out)([first, *out[1:]])
        else:
            return None
        if not self.acted:  # recorded once, at its first micro-batch
            self.injected(factor=self.factor, **what)
        return new

    def _corrupt(self, out: Any) -> Any:
        import torch

        if type(out) is not torch.Tensor:  # a DTensor or other subclass: scaled only (no plain tensor mixed in)
            return out * self.factor
        with torch.no_grad():
            g = torch.Generator(device=out.device).manual_seed(self.step)
            noise = torch.randn(out.shape, generator=g, device=out.device, dtype=out.dtype) * self.factor
        return out * self.factor + noise

    earliest = 12  # loss_spike's MIN_HISTORY steps of history, and a step of margin

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.loss:
            return "no loss was read from the steps (the model's output is not a loss the harness can see)"
        return super().applicable(facts)

    @classmethod
    def fit(cls, facts: Facts) -> dict[str, Any]:
        """On every rank, or, where only some ranks compute the loss (a pipeline's last stage), on the last
        of those: a rank without a loss has no spike to show."""
        ranks = sorted(facts.loss_ranks)
        every = not ranks or len(ranks) == facts.world
        return {**super().fit(facts), **({} if every else {"rank": ranks[-1]})}

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        out = [Expect("loss_spike", ranks=[i["rank"]], step=i["step"], subject="loss") for i in injected]
        if len(injected) == 1 and world > 2:
            out.append(Expect("loss_spike", ranks=[injected[0]["rank"]], step=injected[0]["step"],
                              subject="loss across ranks"))
        return out

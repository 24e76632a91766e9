"""loss_spike: a corrupted step: the model's output is multiplied by `factor` in one step, and gets noise
of `factor`'s size, which is what a corrupted batch does to the loss (scaling the input instead would be
undone by the first BatchNorm; scaling alone barely moves a cross-entropy whose logits are still small,
as an early classifier's are, and not at all a mean-squared error around zero). The noise is seeded by
the step: a replay is repeatable. A loss the model computes itself (a 0-dim floating tensor among its outputs:
nanoGPT's ``(logits, loss)``, a Hugging Face ``ModelOutput``'s ``loss``) is multiplied by `factor`: a spike in
magnitude whatever the loss's sign (a negative loss, a sum of logits, goes `factor` times as far below zero).

Whether it acted is checked at the end of its step, as the training can defeat it: the script's backward must
reach a corrupted tensor (a loss computed from something else than the model's output is not spiked), and the
step's loss must be at least MIN_SPIKE times the recent ones in magnitude (a loss that does not grow with the
output); otherwise the fault says why (``not_acted``) instead of leaving a miss to the detector.

``rank=-1`` (the default) corrupts every rank's step: each rank's own loss spikes. One rank only
also makes that rank's loss depart from the others' (loss_spike's cross-rank check, 3+ ranks).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import TYPE_CHECKING, Any

from distdebug.context import RankContext, StepEvent

from ._targets import inner
from .base import Expect, Fault, Param

if TYPE_CHECKING:
    from .facts import Facts


MIN_SPIKE = 2.0
"""The loss of the corrupted step must be at least this many times the recent losses in magnitude for the fault
to have acted (x30 on the output makes it tens to hundreds of times larger for a cross-entropy, a squared error
or a sum of logits)."""


class LossSpike(Fault):
    name = "loss_spike"
    description = "a corrupted step: the model's output times `factor`, plus noise of that size, at one step"
    factor: float
    params = (Param("rank", int, -1, "the rank it acts on (-1: every rank)"),
              Param("step", int, 20, "the step (>= 12: the spike rule needs a history)"),
              Param("factor", float, 30.0, "the multiplier"))
    catcher = "loss_spike"
    engines = ("ddp", "fsdp2", "zero2", "manual")

    acts_through = "the model's output in its step: a floating-point tensor, or a tuple, list or mapping holding one"

    def attach(self, ctx: RankContext) -> None:
        super().attach(ctx)
        if not self.mine():
            return
        model = inner(ctx)
        if model is None:
            self.not_acted("no model was found: no output to corrupt")
            return
        model.register_forward_hook(self._post)
        self.acts_through = (f"the output of {type(model).__name__}'s forward in step {self.step}: it did not run "
                             "forward then")

    def _post(self, module: Any, args: Any, out: Any) -> Any:
        """The output as the model returns it, corrupted where the script's loss comes from: every loss in it
        (a 0-dim floating tensor: nanoGPT's ``(logits, loss)``, a Hugging Face ``ModelOutput``'s ``loss``) times
        ``factor``, and every other floating tensor in it (the logits, from which a script computes its loss
        outside the model, whichever element they are) times ``factor`` plus noise. A tensor, a mapping, or a
        tuple (a named one too: torchvision's InceptionOutputs) or list; nested containers are left alone."""
        import torch

        def scalable(t: Any) -> bool:
            return isinstance(t, torch.Tensor) and t.is_floating_point()

        # Every forward of the step: its micro-batches (accumulation, a pipeline's schedule) all corrupted.
        if not (self.mine() and self.current == self.step):
            return None
        corrupted: list[str] = []

        def corrupt(key: str, t: Any) -> Any:
            if not scalable(t):
                return t
            new = t * self.factor if t.dim() == 0 else self._corrupt(t)
            corrupted.append(key)
            if new.requires_grad:  # whether the script's backward reaches it (checked at the step's end)
                self.watched = True
                new.register_hook(self._reached)
            return new

        if scalable(out):
            new = corrupt("output", out)
        elif hasattr(out, "keys") and hasattr(out, "__setitem__"):
            for k in list(out.keys()):  # a ModelOutput keeps its attribute in step with the key
                v = corrupt(str(k), out[k])
                if v is not out[k]:
                    out[k] = v
            new = out
        elif isinstance(out, (tuple, list)) and out:
            items = [corrupt(f"output[{i}]", v) for i, v in enumerate(out)]
            new = type(out)(*items) if hasattr(out, "_fields") else type(out)(items)  # a namedtuple by position
        else:
            new = None
        if not corrupted:
            if not self.acted:
                self.not_acted(f"the model's output in step {self.step} holds no floating-point tensor to corrupt (a "
                               f"{type(out).__name__})")
            return None
        if not self.acted:  # recorded once, at its first micro-batch
            self.injected(factor=self.factor, output=", ".join(corrupted))
        return new

    watched = False
    """A corrupted output of the step requires a gradient: the script's backward must reach it."""
    reached = False

    def _reached(self, grad: Any) -> None:
        self.reached = True

    def on_step(self, event: StepEvent) -> tuple[()]:
        """The step after the fault's: did its corruption reach the loss the script backpropagated, and spike
        it? Said (``not_acted``) when not: the loss is computed from something else than the model's output,
        or does not grow with it."""
        if self.acted and event.step == self.step and self.mine():
            self._judge_effect(event)
        elif event.loss is not None and math.isfinite(event.loss):
            self.recent.append(abs(event.loss))
        return super().on_step(event)

    def _judge_effect(self, event: StepEvent) -> None:
        if self.watched and not self.reached and event.backward_calls:
            self.not_acted(f"the model's output corrupted in step {self.step} never reached the loss the script "
                           "called backward() on: the script computes its loss from something else than what "
                           "the model returns")
            return
        if event.loss is None or not self.recent:
            return  # no loss on this rank (a pipeline's first stage): nothing to judge here
        before = statistics.median(self.recent)
        now = abs(event.loss) if math.isfinite(event.loss) else math.inf
        if now < MIN_SPIKE * before:
            self.not_acted(f"the loss the script backpropagated in step {self.step} went from about {before:.4g} "
                           f"to {event.loss:.4g} in magnitude (x{now / before if before else 0:.2g}) under the model's "
                           f"output times {self.factor:g}: it does not grow with the model's output, so no spike "
                           "can show")

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.recent: deque[float] = deque(maxlen=5)  # |loss| of the last steps before the fault's

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
        constant = facts.constant_loss()
        if constant is not None:
            return (f"the clean run's loss was {constant:.6g} at every step on every rank: it does not move with the "
                    "model" + (" (cross-entropy over a single output column is 0 whatever the weights)"
                               if constant == 0 else "") + ", so a spike cannot show")
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

"""transient_compute: one module's output on one rank is wrong once, in one step, and never again (a
marginal unit, a particle strike): the step's first execution only.

What must catch it: ``attach --rerun-on-anomaly``. The wrong value is a NaN in the module's output, so
``nan_origin`` flags the rank at that step; the rank re-executes the step from its capture, the module
computes correctly this time, and ``rerun`` says: not reproducible, a transient fault, suspect the
machine, with the model's output as the first thing that differs. Its twin, ``persistent_compute``,
is wrong on every execution from its step on (a unit that is broken, or a code path): reproducible.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from .base import Expect
from .nan_activation import NanActivation

if TYPE_CHECKING:
    from .facts import Facts


class TransientCompute(NanActivation):
    """nan_activation's NaN (its aim, its hook), acting once in the step's first execution only: the rerun
    detector must call it not reproducible. The re-execution runs one rank's forward alone: data-parallel
    models whose forward does not communicate (DDP, gradients all-reduced by hand)."""

    name = "transient_compute"
    description = "one module's output on one rank is wrong once, in one step (the re-execution computes it right)"
    catcher = "rerun"
    attach_args = ("--rerun-on-anomaly",)
    engines = ("ddp", "manual")
    persistent: ClassVar[bool] = False
    verdict: ClassVar[str] = "not reproducible"

    def acts_now(self) -> bool:
        if not self.mine():
            return False
        step, replays = self.execution()
        if self.persistent:
            return step >= self.step
        return self.current == self.step and not self.acted and replays == 0  # the step as it first ran

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        if not facts.module:
            return "no module with parameters whose output can be made wrong"
        if not facts.wrappers or not facts.wrappers <= {"ddp", "manual", "plain"} or facts.syncbatchnorm \
                or facts.tensor_parallel or facts.pipeline:
            return (f"the model is trained with {facts.wrapper_names}: a step is re-executed on one rank alone only "
                    "where its forward does not communicate (DDP or a hand-written all-reduce, no SyncBatchNorm, "
                    "no tensor or pipeline parallelism)")
        return super().applicable(facts)

    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        return [Expect("rerun", ranks=[i["rank"]], step=i["step"], evidence={"verdict": self.verdict})
                for i in injected]

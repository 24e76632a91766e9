"""What the parity faults share (issue 50): faults a script could have that make N ranks compute something else
than 1 rank, each of one class of ``distdebug.analysis.parity.CAUSES``.

They are judged by ``distdebug parity``, not by a detector of the run they are in: the replay (``faults replay
--recipe parity``) runs the parity recipe at 1 rank (the reference) and as its twin once, then each fault's
candidate at N ranks with ``--parity record`` and the fault injected, and compares. A fault passes when the
candidate departs at the fault's step, at the tensor it names first, with the fault's class as the likely cause;
the clean candidate (no fault) must be equivalent.

Each acts on every rank (a layout's error is every rank's), through the optimizer's step pre-hook (the gradients
as the optimizer will use them) or a module's forward hook, from its step on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from distdebug.context import RankContext

from .base import Fault, Param, ParityExpect

if TYPE_CHECKING:
    from .facts import Facts

EVERY_RANK = Param("rank", int, -1, "the rank it acts on (-1: every rank, as a layout's error is)")


class ParityFault(Fault):
    """A fault judged by ``distdebug parity``. Subclasses set ``cause`` and act from ``step`` on."""

    catcher = "parity"
    engines: ClassVar[tuple[str, ...]] = ("parity",)
    cause: ClassVar[str] = ""
    continuing = True

    @classmethod
    def applicable(cls, facts: Facts) -> str:
        return ("judged by distdebug parity against a 1-rank reference of the same global batch: replayed on the "
                "parity recipe (faults replay --recipe parity); on your script, add --inject "
                f"{cls.name} to the candidate's launch line of distdebug parity")

    def parity_expect(self, injected: list[dict[str, Any]]) -> ParityExpect | None:
        first = min((i["step"] for i in injected if isinstance(i.get("step"), int)), default=None)
        return None if first is None else ParityExpect(first, self.first_quantity(injected), self.cause)

    def first_quantity(self, injected: list[dict[str, Any]]) -> str:
        return "grad"

    def pre_step(self, ctx: RankContext, act: Any) -> None:
        """Call ``act(optimizer)`` before each optimizer step from the fault's step on (guarded)."""
        if not ctx.optimizers:
            self.not_acted("no optimizer was found: no step to act before")
            return
        opt = ctx.optimizers[0]
        if not callable(getattr(opt, "register_step_pre_hook", None)):
            self.not_acted(f"the optimizer ({type(opt).__name__}) takes no step pre-hook")
            return

        def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            if self.mine() and self.current >= self.step:
                act(optimizer)

        opt.register_step_pre_hook(self.guarded(hook))

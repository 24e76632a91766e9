"""Which call ends a training step: the first optimizer to step, a DeepSpeed engine, or ``distdebug.step()``.

Why it is decided, not assumed: scripts step several optimizers (a GAN's two, a scheduler-free second one
for a head), rebuild their optimizer (a fresh one per step, one after a restart), step a throwaway one
before training (to create state), or hand the step to an engine whose inner optimizer ZeRO-3 calls once
per sub-group. One source is chosen and kept: an explicit ``distdebug.step()`` wins over an engine, an
engine over an optimizer; among optimizers, the first to step in a training step (one after a backward),
and after the script dropped it, the next one to step. What the other optimizers' steps mean (a rival
that starts a new training phase, a model no detector watches) is ``runtime.phases``'s to tell; this
says only which optimizer's step it was (``optimizer_stepped``). Pure: unit-tested without torch.
"""

from __future__ import annotations

import weakref
from typing import Any

OPTIMIZER, DEEPSPEED, EXPLICIT = "optimizer", "deepspeed", "explicit"

PRIMARY, CLAIMED, OTHER, ELSEWHERE = "primary", "claimed", "other", "elsewhere"
"""What an optimizer's step was: the boundary's own optimizer; one that just became it (the first, or
the next after the script dropped its own); another optimizer; any optimizer while an engine or
``distdebug.step()`` marks the boundaries."""


class StepSource:
    def __init__(self) -> None:
        self.kind: str | None = None
        """OPTIMIZER, DEEPSPEED or EXPLICIT once a boundary was marked (the discovery record's step_source)."""
        self._primary: weakref.ref[Any] | None = None

    @property
    def primary(self) -> Any:
        """The optimizer whose step marks the boundary (held weakly: the script may drop it), or None."""
        return self._primary() if self._primary is not None else None

    def follow(self, optimizer: Any) -> None:
        """From now on ``optimizer``'s step marks the boundary (a rival that took over)."""
        self._primary = weakref.ref(optimizer)

    def watched(self, optimizer: Any) -> None:
        """``distdebug.watch(optimizer)``: it marks the boundary unless one already does."""
        if self.primary is None:
            self.follow(optimizer)

    def optimizer_stepped(self, optimizer: Any) -> str:
        """What a training step's ``optimizer.step()`` was (PRIMARY, CLAIMED, OTHER or ELSEWHERE)."""
        if self.kind in (EXPLICIT, DEEPSPEED):
            return ELSEWHERE
        if self.primary is None:
            self.follow(optimizer)
            return CLAIMED
        return PRIMARY if optimizer is self.primary else OTHER

    def marks(self, optimizer: Any) -> bool:
        """Whether this optimizer's step ends the step now (and the boundaries are the optimizer's)."""
        if self.kind in (EXPLICIT, DEEPSPEED) or optimizer is not self.primary:
            return False
        self.kind = OPTIMIZER
        return True

    def scaler_skipped(self, optimizer: Any) -> bool:
        """A GradScaler skipped ``optimizer.step()`` (non-finite gradients): whether that ends the step."""
        if self.kind in (EXPLICIT, DEEPSPEED):
            return False
        self.watched(optimizer)
        return self.marks(optimizer)

    def engine_found(self) -> None:
        """A DeepSpeed engine was found: its steps mark the boundaries (an explicit step still wins)."""
        if self.kind in (None, OPTIMIZER):
            self.kind = DEEPSPEED

    def engine_stepped(self) -> bool:
        """A DeepSpeed engine's step at an accumulation boundary: whether it ends the step (not when
        ``distdebug.step()`` marks them)."""
        if self.kind == EXPLICIT:
            return False
        self.kind = DEEPSPEED
        return True

    def explicit(self) -> None:
        """``distdebug.step()``: from now on the script's own calls mark the boundaries."""
        self.kind = EXPLICIT

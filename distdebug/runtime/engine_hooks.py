"""DeepSpeed's engine as the step's source: its loss, its steps, its loss scale, read from the engine itself.

Why the engine and not its optimizer: ZeRO runs backward on the loss-scaled value (the engine's
``backward`` holds the unscaled loss), and ZeRO-3 calls its inner optimizer once per sub-group, so an
optimizer hook would see several steps per training step; the engine's ``step`` at a gradient
accumulation boundary is one. fp16's loss scale and its overflow flag are host values on the engine's
optimizer: read without a device read. Every wrapper is guarded (``cost.quietly``).
"""

from __future__ import annotations

import functools
from typing import Any

from distdebug.runtime.cost import quietly


def hook_deepspeed_engine(patches: Any, engine: Any) -> None:
    """Step and loss from the engine itself (ZeRO calls its inner optimizer once per sub-group). ``patches``:
    the session's ``TorchPatches`` (its ``_in_engine_backward`` keeps the backward patch off meanwhile);
    typed loosely, as patches.py imports this module."""
    session = patches.session
    orig_backward, orig_step = engine.backward, engine.step

    @functools.wraps(orig_backward)
    def backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
        # backward(loss, retain_graph=False, scale_wrt_gas=True): the engine divides the loss by its accumulation
        # steps unless told not to (a host value on the engine)
        by_gas = kwargs.get("scale_wrt_gas", args[1] if len(args) > 1 else True)
        steps = quietly(lambda: float(engine.gradient_accumulation_steps())) if by_gas else None
        quietly(session.note_loss, loss, steps or 1.0)
        patches._in_engine_backward = True
        try:
            out = orig_backward(loss, *args, **kwargs)
        finally:
            patches._in_engine_backward = False
        quietly(session.after_backward)
        return out

    @functools.wraps(orig_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        at_boundary = bool(engine.is_gradient_accumulation_boundary())
        scale = quietly(_deepspeed_scale, engine) if at_boundary else None  # this step's, before its update
        result = orig_step(*args, **kwargs)
        if at_boundary and session.source.engine_stepped():
            skipped = bool(scale is not None and quietly(_deepspeed_overflow, engine))
            quietly(session.boundary, skipped, scale)
        return result

    engine.backward = backward
    engine.step = step


def _deepspeed_scale(engine: Any) -> float | None:
    """DeepSpeed's fp16 loss scale (None without fp16): a host value on its optimizer, no device read."""
    if not engine.fp16_enabled():
        return None
    scale = getattr(getattr(engine, "optimizer", None), "cur_scale", None)
    return float(scale) if isinstance(scale, (int, float)) else None


def _deepspeed_overflow(engine: Any) -> bool:
    """Whether DeepSpeed's fp16 loss scaler skipped the step just taken (its optimizer's host flag)."""
    return bool(getattr(getattr(engine, "optimizer", None), "overflow", False))

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
    import inspect

    session = patches.session
    orig_backward, orig_step = engine.backward, engine.step
    signature = quietly(lambda: inspect.signature(_defined(orig_backward)))  # once: the engine's backward is fixed

    @functools.wraps(orig_backward)
    def backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
        # the division matters to the raw loss only, kept for the parity recorder alone
        divided = quietly(_engine_division, engine, signature, loss, args, kwargs) if session.clock.keep_raw else None
        quietly(session.note_loss, loss, divided or 1.0)
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
    # a direct loss.backward() on the engine's output (newer DeepSpeed, under ZeRO): the engine divides the gradients
    # by its accumulation steps in a hook of its own (_backward_prologue_per_tensor); the loss is divided alike (the
    # backward patch reads this)
    if callable(getattr(engine, "_backward_prologue_per_tensor", None)):
        patches.direct_division = lambda: float(engine.gradient_accumulation_steps())


def _engine_division(engine: Any, signature: Any, loss: Any, args: tuple, kwargs: dict) -> float:
    """What ``engine.backward(loss, ...)`` divides the loss by before backward: its accumulation steps, unless
    ``scale_wrt_gas`` is False (an argument: ``backward(loss, retain_graph, scale_wrt_gas)`` since DeepSpeed 0.17,
    ``backward(loss, allreduce_gradients, release_loss, retain_graph, scale_wrt_gas)`` before, where the engine's
    own ``scale_wrt_gas``, when set, overrides it; ``signature``: ``inspect.signature(_defined(engine.backward))``).
    Host values only."""
    by_gas = signature.bind(engine, loss, *args, **kwargs).arguments.get("scale_wrt_gas", True)
    own = getattr(engine, "scale_wrt_gas", None)
    if own is not None and "allreduce_gradients" in signature.parameters:  # the older engine's override
        by_gas = own
    steps = float(engine.gradient_accumulation_steps()) if by_gas else 1.0
    return steps if steps > 0 else 1.0


def _deepspeed_scale(engine: Any) -> float | None:
    """DeepSpeed's fp16 loss scale (None without fp16): a host value on its optimizer, no device read."""
    if not engine.fp16_enabled():
        return None
    scale = getattr(getattr(engine, "optimizer", None), "cur_scale", None)
    return float(scale) if isinstance(scale, (int, float)) else None


def _deepspeed_overflow(engine: Any) -> bool:
    """Whether DeepSpeed's fp16 loss scaler skipped the step just taken (its optimizer's host flag)."""
    return bool(getattr(getattr(engine, "optimizer", None), "overflow", False))


def _defined(method: Any) -> Any:
    """The function as DeepSpeed defines it (``self`` first) under its decorators: ``instrument_w_nvtx`` wraps
    without ``functools.wraps``, so its signature is ``(*args, **kwargs)``; the function is in its closure."""
    import inspect

    f = getattr(method, "__func__", method)
    for _ in range(4):
        if hasattr(f, "__wrapped__"):
            f = f.__wrapped__
            continue
        cells = []
        for c in f.__closure__ or ():
            try:
                cells.append(c.cell_contents)
            except ValueError:  # a cell not yet filled
                pass
        inner = [c for c in cells if inspect.isfunction(c)]
        if len(inner) != 1 or "self" in inspect.signature(f).parameters:
            break
        f = inner[0]
    return f


"""Where faults aim inside a model: helpers shared by the faults (no torch import until called)."""

from __future__ import annotations

from typing import Any

from distdebug.context import RankContext


def inner(ctx: RankContext) -> Any:
    """The user's own module under any wrapper (DDP, torch.compile), or None before discovery."""
    from distdebug.runtime.discovery import unwrap

    return unwrap(ctx.models[0])[0] if ctx is not None and ctx.models else None


def parameter(ctx: RankContext, name: str) -> tuple[str, Any] | None:
    """The named parameter, or by default the last weight (the first in backward order)."""
    model = inner(ctx)
    if model is None:
        return None
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name:
        return next(((n, p) for n, p in named if n == name), None)
    weights = [(n, p) for n, p in named if n.endswith("weight")] or named
    return weights[-1] if weights else None


def module(ctx: RankContext, name: str) -> tuple[str, Any] | None:
    """The named module, or by default the middle one of those holding parameters."""
    model = inner(ctx)
    if model is None:
        return None
    mods = dict(model.named_modules())
    if name:
        return (name, mods[name]) if name in mods else None
    owners = [(n, m) for n, m in mods.items() if n and next(m.parameters(recurse=False), None) is not None]
    return owners[len(owners) // 2] if owners else None

"""Where faults aim inside a model: helpers shared by the faults (no torch import until called)."""

from __future__ import annotations

from typing import Any

from distdebug.context import RankContext


def inner(ctx: RankContext) -> Any:
    """The user's own module under any wrapper (DDP, torch.compile), or None before discovery."""
    from distdebug.runtime.discovery import unwrap

    return unwrap(ctx.models[0])[0] if ctx is not None and ctx.models else None


def parameter(ctx: RankContext, name: str) -> tuple[str, Any] | None:
    """The named parameter, or by default the last weight (the first in backward order).

    A name is also looked up as an attribute path: with tensor parallelism inside DDP, torch keeps the
    TP parameters as plain DTensor attributes after the first forward (``named_parameters()`` no longer
    lists them; torch.distributed.tensor.parallel.ddp), and they share storage with what the optimizer
    updates."""
    model = inner(ctx)
    if model is None:
        return None
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name:
        found = next(((n, p) for n, p in named if n == name), None)
        if found is None:
            import operator

            try:
                found = (name, operator.attrgetter(name)(model))
            except AttributeError:
                return None
        return found
    weights = [(n, p) for n, p in named if n.endswith("weight")] or named
    return weights[-1] if weights else None


def local(t: Any) -> Any:
    """The tensor this rank holds: a DTensor's local shard, else ``t``. Called under ``torch.no_grad()``,
    where ``DTensor.to_local()`` returns the shard itself (same storage), so writing it writes ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def module(ctx: RankContext, name: str) -> tuple[str, Any] | None:
    """The named module, or by default the middle one of those holding parameters whose computation can
    make a NaN of finite numbers (not an embedding or a normalisation: nan_origin checks their parameters
    and input instead, see FINITE_GIVEN_PARAMETERS_NAMES)."""
    from distdebug.detectors.nan_origin import finite_preserving

    model = inner(ctx)
    if model is None:
        return None
    mods = dict(model.named_modules())
    if name:
        return (name, mods[name]) if name in mods else None
    owners = [(n, m) for n, m in mods.items() if n and next(m.parameters(recurse=False), None) is not None
              and not finite_preserving(m)]
    return owners[len(owners) // 2] if owners else None


def first_float(out: Any) -> Any:
    """The floating-point tensor a module's output leads with (a tensor, or a tuple led by one, as
    nn.MultiheadAttention returns (output, weights)), or None."""
    import torch

    first = out[0] if isinstance(out, tuple) and out else out
    return first if isinstance(first, torch.Tensor) and first.is_floating_point() else None


def with_nan(out: Any) -> Any:
    """``out`` with a NaN in the first element of the tensor it leads with (a copy; whatever the strides)."""
    poisoned = first_float(out).clone()
    poisoned[(0,) * poisoned.dim()] = float("nan")
    return (poisoned, *out[1:]) if isinstance(out, tuple) else poisoned

"""The loss as the user's framework reports it: undoing a framework's division before backward.

With gradient accumulation, accelerate's ``Accelerator.backward(loss)`` runs backward on
``loss / gradient_accumulation_steps``, and Lightning's automatic optimization on the training
step's loss divided by ``Trainer(accumulate_grad_batches=...)``. What backward sees is then a
fraction of the loss the user computed, logged and compares: recorded as is, every step's loss
would be half (or a quarter...) of the script's, and a spike or a cross-rank comparison would be
judged on numbers the user never sees. The framework's own backward is on the call stack of the
``torch.autograd.backward`` the session patches, with the factor on its ``self``: read there, on the
host (a Python attribute, no device value). Frameworks are never imported here: a frame is told by
its function's name and its module's name, and the walk runs only when one of them is loaded.

A loop written by hand that divides its loss by the accumulation steps itself is recorded as it
divides: nothing tells its division from a different loss.
"""

from __future__ import annotations

import sys
from typing import Any

MAX_DEPTH = 12
"""Frames walked up from the backward call: the framework's backward is 2-4 above in practice."""
_MODULES = ("accelerate", "lightning", "pytorch_lightning")
_READERS: dict[Any, Any] = {}  # (code object, module) -> reader of the factor, or None: not a framework's backward


def _accelerate(frame: Any) -> float:
    acc = frame.f_locals.get("self")
    if "DEEPSPEED" in str(getattr(acc, "distributed_type", "")):
        return 1.0  # handed to DeepSpeed's engine undivided (the engine scales it)
    return float(getattr(acc, "gradient_accumulation_steps", 1) or 1)


def _lightning(frame: Any) -> float:
    module = getattr(frame.f_locals.get("self"), "lightning_module", None)
    if module is None or not getattr(module, "automatic_optimization", True):
        return 1.0  # manual optimization: manual_backward(loss) is the user's loss
    trainer = getattr(module, "_trainer", None)
    return float(getattr(trainer, "accumulate_grad_batches", 1) or 1)


def _reader(code: Any, module: str) -> Any:
    if code.co_name != "backward":
        return None
    if module == "accelerate.accelerator":
        return _accelerate
    if module.startswith(("lightning.pytorch.strategies.", "pytorch_lightning.strategies.")):
        return _lightning
    return None


def loaded() -> bool:
    """Whether a framework whose backward divides the loss is imported (cheap: dictionary lookups)."""
    modules = sys.modules
    return any(name in modules for name in _MODULES)


def loss_factor(frame: Any) -> float:
    """What a framework divided the loss by before the backward called under ``frame`` (1.0: none)."""
    depth = 0
    while frame is not None and depth < MAX_DEPTH:
        # Keyed by the module's name too: code objects compare equal by content, not by where they live.
        key = (frame.f_code, frame.f_globals.get("__name__") or "")
        reader = _READERS.get(key, False)
        if reader is False:
            reader = _reader(*key)
            if len(_READERS) < 10_000:  # bounded whatever the script's call sites
                _READERS[key] = reader
        if reader is not None:
            factor = reader(frame)
            return factor if factor > 0 else 1.0
        frame = frame.f_back
        depth += 1
    return 1.0

"""distdebug: find which rank, which step and which tensor broke a distributed training run.

The public API is deliberately tiny, and importing it must stay cheap (no torch), because
``distdebug --help`` and the rank bootstrap both import this package first.

- ``watch(model, optimizer)``: name models/optimizers that automatic discovery cannot see.
- ``step(loss)``: mark a step boundary in loops that do not call a ``torch.optim`` optimizer.
- ``Finding``: what detectors emit.

Outside ``distdebug attach`` both functions do nothing, so scripts may keep the calls.
"""

from __future__ import annotations

from typing import Any

from distdebug.findings import Finding, Severity  # the ground floor: no torch, cheap to import

__version__ = "0.1.0"

__all__ = ["watch", "step", "Finding", "Severity", "__version__"]


def watch(*objects: Any) -> None:
    """Register models (``nn.Module``, DDP, FSDP2 or DeepSpeed engines) and optimizers explicitly.

    The first optimizer given becomes the one whose ``step()`` marks step boundaries.
    A no-op when the process is not running under ``distdebug attach``.
    """
    from distdebug.runtime.session import current_session

    session = current_session()
    if session is not None:
        session.watch(*objects)


def step(loss: Any = None) -> None:
    """Mark the end of one training step on this rank (optionally with its loss tensor or float).

    Once called, automatic step detection (optimizer.step hooks) is switched off for this
    process, so each call is exactly one step. A no-op outside ``distdebug attach``.
    """
    from distdebug.runtime.session import current_session

    session = current_session()
    if session is not None:
        session.explicit_step(loss)

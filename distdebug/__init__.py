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


class _CheckoutFolders:
    """Gives a checkout's top-level fault_injection/ and recipes/ (the design's layout) the names they are
    installed under, ``distdebug.fault_injection`` and ``distdebug.recipes`` (pyproject's package-dir maps
    them into distdebug; a wheel holds no other top-level package). One name in a checkout, an editable
    install and a wheel alike, so no module is loaded twice as two (two fault registries, a class that
    fails isinstance against itself). A meta-path finder for exactly these names: nothing is imported
    until asked for, and nothing else of the checkout's top (tests/, bench/) becomes part of distdebug."""

    def __init__(self, folders: dict[str, str]) -> None:
        self.folders = folders

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> Any:
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        import importlib.util
        import os

        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


def _map_checkout_folders() -> None:
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    top = os.path.dirname(here)
    # Installed from a wheel, they are folders of distdebug's own; in a checkout, folders beside it.
    folders = {f"{__name__}.{name}": os.path.join(top, name) for name in ("fault_injection", "recipes")
               if not os.path.isdir(os.path.join(here, name))
               and os.path.isfile(os.path.join(top, name, "__init__.py"))}
    if folders and not any(isinstance(f, _CheckoutFolders) for f in sys.meta_path):
        sys.meta_path.append(_CheckoutFolders(folders))  # last: an editable install's finder maps the same


_map_checkout_folders()


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

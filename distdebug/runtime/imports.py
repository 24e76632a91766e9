"""Acting on a module when the script imports it, without importing it ourselves.

Optional libraries (torch.distributed.checkpoint, safetensors, accelerate...) are wrapped only in runs
that use them: a run without them never pays for importing them, and nothing of ours changes what
an import finds. ``when_imported(name, then)`` calls ``then(module)`` at once if ``name`` is already
imported, else right after its code has run (before any ``from name import x`` binds ``x``).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any


class ImportHook(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` right after ``name`` is imported by anyone; never changes what is found."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        self.remove()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        then = self.then

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def when_imported(name: str, then: Any) -> ImportHook | None:
    """``then(module)`` now if ``name`` is imported, else when it is: returns the hook to remove, if any."""
    if name in sys.modules:
        then(sys.modules[name])
        return None
    hook = ImportHook(name, then)
    sys.meta_path.insert(0, hook)
    return hook

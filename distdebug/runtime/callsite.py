"""The user's line behind a call into torch: the innermost frame that is not ours, an injected fault's,
torch's or the standard library's.

A detector that patches torch (``DistributedSampler.__iter__``) is called from under several layers:
the DataLoader's iterator, a replay probe's or a fault's wrapper around it (``fault_injection``), the
harness's guarded patch. Telling them apart by a word in the path ("distdebug" in the file name) both
misses a layer (fault_injection's) and skips a user whose project lives in a folder of that name; the
packages' own folders say exactly which frames are theirs.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from functools import lru_cache
from typing import Any

INTERNAL_PACKAGES = ("distdebug", "distdebug.fault_injection", "fault_injection", "torch")
"""Packages whose frames are never the user's line. In a checkout the faults' folder sits beside distdebug's
(imported as distdebug.fault_injection: its own folder is looked up); where a run has not loaded it, no
frame of it can be on the stack. recipes/ are not here: they are a user's training script."""


_THIRD_PARTY = ("site-packages", "dist-packages")


@lru_cache(maxsize=1)
def _stdlib() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.join(paths[k], "") for k in ("stdlib", "platstdlib") if paths.get(k)})


def _package_dirs() -> tuple[str, ...]:
    """The folders of the internal packages this process has loaded (a package not loaded has no frame)."""
    out = []
    for name in INTERNAL_PACKAGES:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            out.append(os.path.join(os.path.dirname(path), ""))
    return tuple(out)


def internal(filename: str, dirs: tuple[str, ...] | None = None) -> bool:
    """Whether a frame of this file is harness, fault, torch or standard-library code."""
    if filename.startswith("<frozen "):  # runpy, importlib: the standard library's frozen modules
        return True
    if filename.startswith(_stdlib()) and not any(f"{os.sep}{d}{os.sep}" in filename for d in _THIRD_PARTY):
        return True  # installed packages may lie under the standard library's folder (lightning's loops: kept)
    return filename.startswith(dirs if dirs is not None else _package_dirs())


def user_site(depth: int = 1) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost user frame above the caller's ``depth`` (1: its caller);
    None when every frame is internal. Walks frame objects: no source line is read."""
    try:
        f: Any = sys._getframe(depth + 1)
    except ValueError:
        return None
    dirs = _package_dirs()
    while f is not None:
        name = f.f_code.co_filename
        if not internal(name, dirs):
            return name, f.f_lineno, f.f_code.co_name
        f = f.f_back
    return None


def user_line() -> str:
    """'file.py:LINE' of the innermost user frame (``user_site``), or '' when every frame is internal."""
    site = user_site(2)
    return f"{os.path.basename(site[0])}:{site[1]}" if site else ""

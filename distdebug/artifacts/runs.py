"""Choosing a new run directory and finding an existing one by name, path or recency."""

from __future__ import annotations

import os
import time
from pathlib import Path

from distdebug.artifacts import layout
from distdebug.errors import UserError


def runs_root(cwd: Path | None = None) -> Path:
    return (cwd or Path.cwd()) / layout.DEFAULT_RUNS_ROOT


def new_run_dir(label: str, root: Path | None = None) -> Path:
    """``distdebug-runs/YYYYmmdd-HHMMSS-<label>`` (suffixed ``-2``, ``-3``... if taken), created here.

    Claimed by ``mkdir`` itself, not by a look before: two launches in the same second on one machine
    (a CI matrix, test workers side by side) never share a directory. Where it cannot be created the
    path is returned as it is, for ``prepare_run_dir`` to say why in one line."""
    root = root or runs_root()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{stamp}-{label}" if label else stamp
    candidate, n = root / base, 2
    while True:
        try:
            root.mkdir(parents=True, exist_ok=True)
            candidate.mkdir()
            return candidate
        except FileExistsError:
            candidate = root / f"{base}-{n}"
            n += 1
        except OSError:
            return candidate


def prepare_run_dir(path: Path) -> Path:
    """Create ``path`` and prove it is writable, or raise a one-line UserError."""
    path = path.expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
        # One probe per process: launchers of several nodes on one host may share the run directory
        # and prepare it at the same moment (one's unlink must not take away the other's probe).
        probe = path / f".write-test.{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UserError(
            f"cannot write the run directory {path}: {e.strerror or e}; "
            "choose another with --run-dir"
        ) from None
    return path


def mark_latest(run_dir: Path) -> None:
    """Point ``<root>/latest`` at run_dir (best effort; resolution falls back to mtime)."""
    link = run_dir.parent / layout.LATEST_LINK
    tmp = run_dir.parent / f".{layout.LATEST_LINK}.{os.getpid()}"
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(run_dir.name)
        os.replace(tmp, link)
    except OSError:
        pass


def resolve_run(run: str | None, cwd: Path | None = None) -> Path:
    """A run directory from a path, a name under ./distdebug-runs, or (None) the newest run."""
    root = runs_root(cwd)
    if run:
        for candidate in (Path(run).expanduser(), root / run):
            if candidate.is_dir():
                if not is_run_dir(candidate):
                    raise UserError(f"{run} is not a distdebug run directory (no {layout.MANIFEST}, no rank-NNNNN/ "
                                    "folders): give the directory 'distdebug attach' printed")
                return candidate.resolve()
        raise UserError(f"no run directory '{run}': give a path, or a name under {root}")
    link = root / layout.LATEST_LINK
    if link.is_dir():
        return link.resolve()
    runs = [p for p in root.glob("*") if p.is_dir() and not p.is_symlink()] if root.is_dir() else []
    if not runs:
        raise UserError(f"no runs under {root}: start one with 'distdebug attach SCRIPT', or name a run directory")
    return max(runs, key=lambda p: p.stat().st_mtime).resolve()


def is_run_dir(path: Path) -> bool:
    """A directory attach wrote (a manifest, or at least one rank's folder: a run killed early), or one
    it has just made and not written yet (empty). Any other directory (``/etc``) is not a run."""
    try:
        children = list(path.iterdir())
    except OSError:
        return False
    return not children or (path / layout.MANIFEST).exists() or any(
        layout.rank_of_dir(c.name) is not None and c.is_dir() for c in children)


def sibling_runs(run_dir: Path, newest: int) -> list[Path]:
    """The other finished-or-running runs beside ``run_dir`` (the same runs root: those with a manifest),
    newest first, at most ``newest`` of them."""
    here = Path(run_dir).resolve()
    try:
        runs = [d for d in here.parent.iterdir()
                if d.is_dir() and not d.is_symlink() and d.resolve() != here and layout.manifest_path(d).exists()]
    except OSError:
        return []
    return sorted(runs, key=lambda d: d.stat().st_mtime, reverse=True)[:newest]


"""Isolated runs for ``distdebug faults replay SCRIPT`` (issue 46): pure file operations, no torch.

A script that keeps state in files leaks it from one run of the replay into the next: the pytorch/examples
DDP tutorial saves ``snapshot.pt`` in its working directory and resumes from it, so every run after the clean
one resumed from the clean run's snapshot (a fault's step never came) and the user's directory was left with
a NaN snapshot. So:

- ``Snapshot``: the working directory as it was before the replay, taken once. Each run starts in a copy of
  it of its own (``Isolation.copy``): regular files copied, smallest first, up to a size per file and a total
  budget; a bigger file, or one past the budget, is linked (a dataset is read, not written) and its (size,
  mtime) watched, so that a run that wrote through the link to the user's file is said. Folders a script
  reads but never writes (version control, node_modules, virtualenvs, tools' caches, earlier distdebug runs,
  a folder of more than ``MAX_FOLDER_ENTRIES`` entries: a dataset) are linked whole; ``__pycache__`` is copied with
  its sources (a copy keeps the source's time, so the bytecode stays valid and no run compiles the copy again:
  a second or so of CPU a rank where the working directory holds a package), never linked (Python would write
  the copy's bytecode into the user's folder): what does not fit is left out, compiled again; the replay's own work
  dir, which is inside the working directory by default, is never in the copy. Symlinks stay symlinks.
- Files written outside the working directory: the replay's probe (the clean run) calls ``before_save``
  before the first torch.save to each path, and before an os.replace / os.rename of a file torch.save wrote
  (an atomic save: ``torch.save(obj, tmp); os.replace(tmp, ckpt)``); it keeps whether the path existed and a
  copy of the file that was there, so that the replay puts every such path back between runs and after the
  last (``Isolation.restore``), also when the replay is cut short during the clean run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from distdebug.artifacts import layout

MAX_FILE_BYTES = 64 << 20
"""A file bigger than this is linked into each run's copy, not copied."""
BUDGET_BYTES = 1 << 30
"""At most this many bytes are copied into each run's copy (the smallest files first); the rest are linked."""
MAX_FOLDER_ENTRIES = 10_000
"""A folder (not the working directory itself) holding more entries than this, at any depth, is linked whole:
a dataset of many small files, which a copy per run would only slow down."""
LINKED_FOLDERS = frozenset({".git", ".hg", ".svn", "node_modules", layout.DEFAULT_RUNS_ROOT, ".mypy_cache",
                            ".ruff_cache", ".pytest_cache", ".tox", ".nox"})
"""Folders a training script reads at most (version control, the harness's runs, packages, tools' caches):
linked whole, as a folder holding pyvenv.cfg (a virtualenv) is."""
CACHES = frozenset({"__pycache__"})
"""Folders never linked (Python writes in them: bytecode); their files are copied with the rest, smallest first
within the budget, and a file that does not fit is left out (its source is compiled again by the run), as is a
folder of too many entries."""
COPY_FOLDER = "cwd"
"""The folder of a run's copy in its cell's folder (beside its run dir)."""
BACKUP_FOLDER = "saved-outside"
"""The folder of the work dir where the probe keeps what was at each path the clean run saved outside."""
CLAIM_WAIT_S = 30.0
"""How long a rank that saves to a path another rank claimed waits for that rank's copy of the file that was
there (its save would truncate the file mid-copy); past it, the save goes ahead (the claimer died)."""


@dataclass(frozen=True)
class Entry:
    """One path of the snapshot, relative to the working directory (``/``-separated)."""

    rel: str
    kind: str
    """dir (made in the copy) | copy (a regular file copied) | link (linked to the user's) | symlink (kept)"""
    size: int = 0
    """Bytes of a file (0 for a folder)."""
    mtime_ns: int = 0
    why: str = ""
    """Of a link: big (over the size per file), budget (past the total budget), folder (one of LINKED_FOLDERS or
    a virtualenv, or inside one), many (more than MAX_FOLDER_ENTRIES entries), other (not a regular file)."""
    target: str = ""
    """Of a symlink: what it points to; made absolute when it points out of the working directory (relative,
    it would point elsewhere from the copy)."""
    folder: bool = False
    """A linked folder (not a file)."""

    @property
    def watched(self) -> bool:
        """A linked file a run could write through to the user's, or a folder of many entries (its mtime: an
        entry made or removed in it). A folder of LINKED_FOLDERS is not: something else, a concurrent run or
        the user's tools, may write in it."""
        return self.kind == "link" and self.why in ("big", "budget", "many")


class _Many(Exception):
    """A folder over MAX_FOLDER_ENTRIES: linked whole instead of walked further."""


@dataclass
class Snapshot:
    """The working directory as it was before the replay (``take``), made again for each run (``make``)."""

    source: Path
    entries: list[Entry] = field(default_factory=list)
    _seen: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    @classmethod
    def take(cls, source: Path, exclude: tuple[Path, ...] = (), max_file: int = MAX_FILE_BYTES,
             budget: int = BUDGET_BYTES, max_entries: int = MAX_FOLDER_ENTRIES) -> Snapshot:
        """Walk ``source`` (symlinks not followed). ``exclude``: paths never in the copy (the replay's work dir);
        the folders that hold one are made, their other entries taken as usual (linked, inside a linked
        folder such as distdebug-runs)."""
        root = Path(os.path.realpath(source))
        skip = {Path(os.path.realpath(p)) for p in exclude}
        holders = {a for s in skip for a in s.parents}

        def visit(folder: Path, rel: str, link_all: bool, limit: int | None) -> tuple[list[Entry], list[Entry]]:
            dirs: list[Entry] = []
            files: list[Entry] = []
            for item in sorted(os.scandir(folder), key=lambda e: e.name):  # OSError: unreadable, said by the caller
                path, r = Path(item.path), rel + item.name
                if path in skip:
                    continue
                try:
                    st = item.stat(follow_symlinks=False)
                except OSError:
                    continue  # vanished while walked
                if stat.S_ISLNK(st.st_mode):
                    dirs.append(Entry(r, "symlink", target=_link_target(path, root)))
                elif stat.S_ISDIR(st.st_mode):
                    inner = link_all or item.name in LINKED_FOLDERS or (path / "pyvenv.cfg").is_file()
                    if path in holders:
                        dirs.append(Entry(r, "dir"))
                        d, f = visit(path, r + "/", inner, None)
                        dirs += d
                        files += f
                    elif inner:
                        dirs.append(Entry(r, "link", why="folder", folder=True))
                    elif item.name in CACHES:
                        try:
                            d, f = visit(path, r + "/", False, max_entries)
                        except (_Many, OSError):
                            continue
                        dirs += [Entry(r, "dir"), *d]
                        files += f
                    else:
                        try:
                            d, f = visit(path, r + "/", False, max_entries)
                        except _Many:
                            dirs.append(Entry(r, "link", 0, st.st_mtime_ns, why="many", folder=True))
                            continue
                        except OSError:  # unreadable: a link is the most a run could use
                            dirs.append(Entry(r, "link", why="other", folder=True))
                            continue
                        dirs += [Entry(r, "dir"), *d]
                        files += f
                elif link_all or not stat.S_ISREG(st.st_mode):
                    dirs.append(Entry(r, "link", st.st_size, st.st_mtime_ns, why="folder" if link_all else "other"))
                else:
                    files.append(Entry(r, "copy", st.st_size, st.st_mtime_ns))
                if limit is not None and len(dirs) + len(files) > limit:
                    raise _Many
            return dirs, files

        try:
            dirs, files = visit(root, "", False, None)
        except OSError:  # the working directory itself unreadable: the script could not run from it either
            dirs, files = [], []
        used = 0
        chosen: list[Entry] = []
        for f in sorted(files, key=lambda f: (f.size, f.rel)):  # smallest first: the code and configs are copied
            if (f.size > max_file or used + f.size > budget) and _in_cache(f.rel):
                continue  # bytecode is never linked: Python compiles the source again instead
            if f.size > max_file:
                chosen.append(Entry(f.rel, "link", f.size, f.mtime_ns, why="big"))
            elif used + f.size > budget:
                chosen.append(Entry(f.rel, "link", f.size, f.mtime_ns, why="budget"))
            else:
                used += f.size
                chosen.append(f)
        snap = cls(root, dirs + chosen)  # every folder before what it holds
        snap._seen = {e.rel: (e.size, e.mtime_ns) for e in snap.entries if e.watched}
        return snap

    @property
    def copied(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == "copy"]

    @property
    def linked(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == "link"]

    def make(self, dest: Path) -> None:
        """Make the copy at ``dest`` (which must not exist). Raises OSError (a full disk)."""
        dest.mkdir(parents=True)
        for e in self.entries:
            to, src = dest / e.rel, self.source / e.rel
            if e.kind == "dir":
                to.mkdir()
            elif e.kind == "symlink":
                os.symlink(e.target, to)
            elif e.kind == "copy":
                try:
                    shutil.copy2(src, to, follow_symlinks=False)
                except (PermissionError, FileNotFoundError):  # unreadable, or gone since: as the script would
                    os.symlink(src, to)
            else:
                os.symlink(src, to)

    def changed(self) -> list[Entry]:
        """The linked files whose size or mtime changed since the snapshot (or since they were last said): a run
        wrote through a link to the user's file. Each change is returned once."""
        out = []
        for e in self.entries:
            if e.rel not in self._seen:
                continue
            try:
                st = os.stat(self.source / e.rel)
                # A folder (many): its mtime moves when an entry is made or removed in it; its size means nothing.
                now = (0 if e.why == "many" else st.st_size, st.st_mtime_ns)
            except OSError:
                now = (-1, -1)
            if now != self._seen[e.rel]:
                self._seen[e.rel] = now
                out.append(e)
        return out

    def path_in_copy(self, path: str, copy: Path) -> str:
        """A path given relative to the working directory or absolute: the same file in ``copy`` when it is
        inside the working directory, else the absolute path (a relative one that climbs out resolves
        elsewhere from the copy)."""
        # Resolved on both sides: a working directory reached through a symlink (macOS's /tmp, a linked home)
        # or a script given by a linked path is still the copy's file, not the user's run in place.
        full = os.path.realpath(os.path.join(self.source, path))
        rel = os.path.relpath(full, os.path.realpath(self.source))
        if rel == "." or rel.startswith(".." + os.sep) or rel == "..":
            return full
        return str(copy / rel)


def _in_cache(rel: str) -> bool:
    return any(part in CACHES for part in rel.split("/")[:-1])


def _link_target(link: Path, root: Path) -> str:
    target = os.readlink(link)
    if os.path.isabs(target):
        return target
    full = os.path.normpath(os.path.join(link.parent, target))
    return target if _under(full, str(root)) else full


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


# ---------------------------------------------------------------- files saved outside the working directory
@dataclass(frozen=True)
class Saved:
    """A path the clean run saved to outside its copy, and what was there before it."""

    path: str
    existed: bool | None
    """None: not known (the script opened the file itself before torch.save wrote into it, or the copy of what
    was there was cut short)."""
    backup: Path | None = None
    """The copy of what was there; with ``existed`` None, a copy cut short: never put back, only kept."""
    failed: str | None = None
    """Why no copy was kept of a file that was there (the disk's error): it cannot be put back."""


def before_save(path: str, backups: str | None, opened: bool = False) -> bool | None:
    """Called by the probe (each rank of the clean run) before a torch.save to ``path``: whether it existed
    (None when ``opened``: the script opened the file itself, and it is already truncated). With ``backups``
    (DISTDEBUG_REPLAY_BACKUP: a folder of the replay's work dir), a path outside that work dir (which holds every
    run's copy) is claimed once for the whole run by the first rank to save it (a folder made atomically), and
    the file that was there is copied into it."""
    real = os.path.realpath(path)
    existed = None if opened else os.path.isfile(real)
    if not backups or _under(real, os.path.realpath(os.path.dirname(os.path.abspath(backups)))):
        return existed
    slot = Path(backups) / hashlib.sha1(real.encode()).hexdigest()[:16]
    try:
        slot.mkdir(parents=True)
    except FileExistsError:
        # Another rank (or an earlier save of this rank) has it: wait until its copy is done, or this save
        # would truncate the file while it is being copied.
        _wait_done(slot, CLAIM_WAIT_S)
        return existed
    _write_entry(slot, real, None)  # first the path: a copy cut short leaves it known, as not restorable
    failed = None
    if existed:
        try:
            shutil.copy2(real, slot / "original")
        except OSError as e:  # a full or failing disk: no copy, said at restore; the other ranks do not wait
            failed = f"{e.strerror or e}"
            with contextlib.suppress(OSError):
                (slot / "original").unlink()
    _write_entry(slot, real, existed, done=True, failed=failed)
    return existed


def _write_entry(slot: Path, path: str, existed: bool | None, done: bool = False, failed: str | None = None) -> None:
    tmp = slot / f"entry.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"path": path, "existed": existed, "done": done, "failed": failed}))
    os.replace(tmp, slot / "entry.json")


def _wait_done(slot: Path, timeout: float, poll: float = 0.02) -> bool:
    """Until the claimer's entry says its copy is done (the second write of entry.json); False past ``timeout``
    seconds."""
    end = time.monotonic() + timeout
    while True:
        try:
            if json.loads((slot / "entry.json").read_text()).get("done"):
                return True
        except (OSError, ValueError):
            pass  # not written yet
        if time.monotonic() >= end:
            return False
        time.sleep(poll)


def saved_outside(backups: Path) -> list[Saved]:
    """What ``before_save`` kept, sorted by path."""
    out = []
    for slot in sorted(backups.iterdir()) if backups.is_dir() else ():
        try:
            entry = json.loads((slot / "entry.json").read_text())
        except (OSError, ValueError):
            continue
        existed = entry.get("existed")
        original = slot / "original"
        kept = original if existed is not False and original.is_file() else None  # None: perhaps cut short
        out.append(Saved(str(entry["path"]), existed, kept, entry.get("failed")))
    return sorted(out, key=lambda s: s.path)


def restore(saved: list[Saved]) -> list[str]:
    """Put each path back as it was before the clean run: remove what it created, copy back what it overwrote.
    Returns what could not be put back (one line each)."""
    problems = []
    for s in saved:
        try:
            if s.existed is False:
                if os.path.lexists(s.path) and not os.path.isdir(s.path):
                    os.unlink(s.path)
            elif s.existed and s.backup is not None:
                os.makedirs(os.path.dirname(s.path), exist_ok=True)
                shutil.copy2(s.backup, s.path)
            elif s.existed and s.failed:
                problems.append(f"could not put back {s.path}: no copy of it could be kept before the clean run "
                                f"saved over it ({s.failed})")
        except OSError as e:
            problems.append(f"could not put back {s.path}: {e.strerror or e}")
    return problems


# ---------------------------------------------------------------- one replay's isolation
class Isolation:
    """One script replay's isolation: the snapshot of the working directory, each run's copy, the paths
    outside it put back between runs, and what a run changed through a link. Used by fault_injection.matrix;
    said by the CLI (fault_injection.console.isolation)."""

    def __init__(self, source: Path, work: Path, max_file: int = MAX_FILE_BYTES, budget: int = BUDGET_BYTES):
        self.work = Path(os.path.realpath(work))
        self.snapshot = Snapshot.take(source, exclude=(self.work,), max_file=max_file, budget=budget)
        self.backups = self.work / BACKUP_FOLDER
        self.saved: list[Saved] = []
        """Paths outside the copy the clean run saved to (known after ``learn``)."""
        self.changed: list[tuple[str, Entry]] = []
        """(run, linked entry) for each user's file a run changed through a link."""
        self.problems: list[str] = []
        self.serial_from = 0
        """The -j asked when the runs went one at a time because they share paths outside, or the clean run
        wrote through a link to the user's file (0: not forced)."""
        self.kept: Path | None = None
        """After ``close``: the backups folder, when something in it was not put back (the user's way back)."""
        self._put_back = False
        self._lock = threading.Lock()

    @property
    def source(self) -> Path:
        return self.snapshot.source

    def copy(self, folder: Path) -> Path:
        """Make a run's copy in its cell's folder; returns the folder to run in. It sits in a folder that links
        what is beside the working directory, so that a relative path that climbs out of it (``../data``)
        finds what it finds from the working directory. Raises OSError."""
        parent = folder / COPY_FOLDER
        shutil.rmtree(parent, ignore_errors=True)
        parent.mkdir(parents=True)
        up = self.source.parent
        if up != self.source:
            with contextlib.suppress(OSError):
                for item in os.scandir(up):
                    if item.name != self.source.name:
                        os.symlink(item.path, parent / item.name)
        dest = parent / self.source.name if up != self.source else parent / "root"
        self.snapshot.make(dest)
        return dest

    def remove_copy(self, folder: Path) -> None:
        shutil.rmtree(folder / COPY_FOLDER, ignore_errors=True)

    def script(self, argv: list[str], copy: Path) -> list[str]:
        """SCRIPT [ARGS] with SCRIPT pointed at the copy when it is inside the working directory."""
        return [self.snapshot.path_in_copy(argv[0], copy), *argv[1:]] if argv else argv

    def learn(self) -> None:
        """After the clean run: the paths outside the copy it saved to."""
        self.saved = saved_outside(self.backups)

    def restore(self) -> None:
        """Put back every path outside the copy the clean run saved to (between runs, and after the last).
        Reads the backups itself (``learn``): a replay cut short during the clean run (Ctrl-C) has not learnt
        them yet, and its paths must be put back all the same."""
        with self._lock:
            self.learn()
            problems = restore(self.saved)
            for p in problems:
                if p not in self.problems:
                    self.problems.append(p)
            # A copy cut short (existed unknown) is never copied back: the backups stay, for the user to judge.
            self._put_back = not problems and not any(s.existed is None and s.backup for s in self.saved)

    def watch(self, run: str) -> None:
        """After a run: the linked user's files it changed."""
        with self._lock:
            self.changed += [(run, e) for e in self.snapshot.changed()]

    def close(self) -> None:
        """After the replay (after ``restore``): the copies kept of the files outside are removed only when every
        path was put back; else (one could not be, or ``restore`` never finished) they are the user's way back,
        kept in ``kept`` and said."""
        if self._put_back and not self.problems or not self.backups.exists():
            shutil.rmtree(self.backups, ignore_errors=True)
        else:
            self.kept = self.backups

"""The node's one watcher of ``distdebug stacks``' request file (issue 48, item 5): the launcher agent looks at
it (one ``stat`` every half second, on the shared file system) and wakes its own ranks through their pipes
in a node-local folder (``runtime.wake``); the ranks never look at the run directory for it. File system
operations a second: O(nodes), not O(ranks)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from distdebug import envvars
from distdebug.artifacts import layout
from distdebug.runtime.wake import wake_all

PREFIX = "distdebug-wake-"
"""The folders' names: the prefix, the launcher's pid, a dash, mkdtemp's random part."""


def sweep(tmp: Path) -> list[Path]:
    """Remove the wake-up folders of launchers that are gone (a launcher killed by SIGKILL cannot remove its own;
    its orphaned ranks remove their pipes and, the last, the empty folder: this catches what is left). A folder
    whose pid runs is left alone (a live launcher, or the pid reused: left for later). What was removed."""
    gone: list[Path] = []
    try:
        folders = [p for p in tmp.iterdir() if p.name.startswith(PREFIX)]
    except OSError:
        return gone
    for folder in folders:
        pid_s = folder.name[len(PREFIX):].split("-", 1)[0]
        if not pid_s.isdigit() or _alive(int(pid_s)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            gone.append(folder)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


class StacksRelay:
    """Makes the node-local folder (its path in ``DISTDEBUG_WAKE_DIR`` for the ranks), watches the request
    file from a thread, removes the folder at ``stop``. A folder it cannot make leaves the ranks polling."""

    def __init__(self, run_dir: Path, interval: float = 0.5) -> None:
        self.run_dir = run_dir
        self.interval = interval
        self.folder: Path | None = None
        self.stats = 0
        self.relayed = 0
        self._seen: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="distdebug-stacks-relay", daemon=True)

    def start(self) -> None:
        sweep(Path(tempfile.gettempdir()))
        try:
            self.folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        except OSError:
            os.environ[envvars.WAKE_DIR] = ""  # empty: the ranks poll
            return
        os.environ[envvars.WAKE_DIR] = str(self.folder)
        self._seen = self._stamp()  # an old request (a reused run directory) is not a new one
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _stamp(self) -> int | None:
        self.stats += 1
        try:
            return layout.stacks_request_path(self.run_dir).stat().st_mtime_ns
        except OSError:
            return None

    def _loop(self) -> None:
        assert self.folder is not None
        while not self._stop.wait(self.interval):
            try:
                stamp = self._stamp()
                if stamp is not None and stamp != self._seen:
                    self._seen = stamp
                    wake_all(self.folder)
                    self.relayed += 1
            except Exception:  # the relay never takes the launcher down; the ranks' answers are then missing
                pass

"""attach's status line: one line for this node's ranks, refreshed in place on the terminal while the job runs
(step, steps/s, last loss, slowest rank, findings so far). Only when the output is a terminal: a job whose
output goes to a file or a pipe (a scheduler's log, CI) gets nothing extra. A thread of the launcher reads
the ranks' records (analysis.live); the ranks themselves do nothing for it."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from distdebug import envvars
from distdebug.analysis.live import Follower, node_line

INTERVAL_S = 1.0


class StatusLine:
    def __init__(self, run_dir: Path, node: int, stream: TextIO | None = None, interval: float = INTERVAL_S) -> None:
        self.follower = Follower([run_dir])
        self.node = node
        self.stream = stream or sys.stderr
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shown = False

    @staticmethod
    def wanted(stream: TextIO | None = None) -> bool:
        """When the output is a terminal (stdout, and the stream the line goes to), unless DISTDEBUG_STATUS=0."""
        stream = stream or sys.stderr
        try:
            return stream.isatty() and sys.stdout.isatty() and envvars.get(envvars.STATUS, "1") != "0"
        except (AttributeError, ValueError):
            return False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="distdebug-status", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
        if self._shown:
            self._write("\r\x1b[K")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self._stop.set()  # the terminal went away: nothing more to show

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                ranks = [r for r in self.follower.poll().values() if r.node in (None, self.node)]
                line = node_line(ranks, now=time.time())
            except Exception:  # never into the launcher: the line is a convenience
                continue
            width = shutil.get_terminal_size((120, 20)).columns
            self._write("\r\x1b[K" + line[: max(20, width - 1)] + "\r")
            self._shown = True

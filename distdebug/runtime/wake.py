"""A rank's wake-up pipe: how ``distdebug stacks`` reaches thousands of ranks without their polling a file.

Before, every rank's watchdog stat'ed the run directory's request file twice a second: at 4,096 ranks that is
8,000 operations a second on a shared file system, all the job long, for a command run once a week. Now one
watcher per node (the launcher's relay, ``launch.relay``) looks at the request file, and tells its own ranks
through a named pipe each rank holds in a node-local folder (``DISTDEBUG_WAKE_DIR``, in the launcher's
temporary directory, never on the shared file system): the rank's watchdog thread waits on its pipe with
``poll`` instead of sleeping, so a request wakes it at once, and no request costs it nothing. A rank started
without the folder (another launcher) polls as before.
"""

from __future__ import annotations

import os
import select
from pathlib import Path

FIFO_TEMPLATE = "rank-{rank:05d}.wake"


def fifo_path(folder: Path, rank: int) -> Path:
    return folder / FIFO_TEMPLATE.format(rank=rank)


class WakePipe:
    """The rank's end: made and opened read-write (so that it never reads an end of file when no writer is
    there, which would make ``poll`` return at once, forever), non-blocking."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = fifo_path(folder, rank)
        self.parent = os.getppid()
        try:
            self.path.unlink()  # a previous attempt's pipe (an elastic restart of this rank)
        except FileNotFoundError:
            pass
        os.mkfifo(self.path, 0o600)
        self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        self._poll = select.poll()  # not select(): no limit on the descriptor's number
        self._poll.register(self.fd, select.POLLIN)

    def wait(self, timeout: float) -> bool:
        """Sleep until woken or ``timeout`` seconds; whether woken (what was written is drained)."""
        if self.fd < 0:
            return False
        if not self._poll.poll(timeout * 1000):
            return False
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass
        return True

    def poke(self) -> None:
        """Wake the waiting thread (its own stop)."""
        try:
            os.write(self.fd, b"!")
        except OSError:
            pass

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            mine = os.fstat(self.fd).st_ino == self.path.stat().st_ino
        except OSError:
            mine = False
        os.close(self.fd)
        self.fd = -1
        if mine:  # not the pipe a restarted attempt of this rank made in its place
            try:
                self.path.unlink()
            except OSError:
                pass
        if os.getppid() != self.parent:  # the launcher is gone and cannot remove its folder: the last rank does
            try:
                self.path.parent.rmdir()  # only when empty: the other ranks' pipes keep it
            except OSError:
                pass


def wake_all(folder: Path) -> int:
    """The relay's end: one byte into every rank's pipe in ``folder`` (a rank that is gone, or whose pipe is
    full of earlier wake-ups, is skipped); how many were woken."""
    woken = 0
    try:
        pipes = [p for p in folder.iterdir() if p.name.endswith(".wake")]
    except OSError:
        return 0
    for p in pipes:
        try:
            fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader (the rank ended)
            continue
        try:
            os.write(fd, b"!")
            woken += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return woken

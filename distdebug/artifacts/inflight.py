"""The collective a rank is inside right now, kept in a small memory-mapped file (``layout.INFLIGHT``).

Part of the run directory's contract: the rank writes it (``InflightSlot``, installed by the rank's
bootstrap), the analysis reads it after the job or a crash (``read_inflight``), so it lives here.

Why mmap: a rank can die inside a collective without running any Python again (gloo aborts the
process on a size mismatch; SIGKILL). A store into a shared file mapping is a memory write, not
a system call, and the kernel keeps it after the process dies, so the supervisor can still read
which collective (op, sequence number, shapes) the rank was in.

Layout of the 4 KiB file: byte 0 state (0 empty, 1 inside, 2 finished, 3 failed), bytes 1-4
payload length (little endian), then the JSON payload. "failed" is written when the collective
raised: the launcher may kill the rank before its error record reaches the event stream, and
the slot must still say which collective failed.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Any

from distdebug import strictjson

SIZE = 4096
EMPTY, INSIDE, FINISHED, FAILED = 0, 1, 2, 3
"""The state byte as written."""
SLOT_EMPTY, SLOT_INSIDE, SLOT_FINISHED, SLOT_FAILED = "empty", "inside", "finished", "failed"
"""The state as ``read_inflight`` names it."""


class InflightSlot:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # Written, not truncated to size: a sparse file gets its block at the first store into the
            # mapping, and on a full file system that store is a SIGBUS that kills the rank (and the job)
            # inside its first collective. Written here, a full disk is an OSError at start-up instead,
            # and the rank runs without the slot (launch.bootstrap).
            if os.write(fd, bytes(SIZE)) != SIZE:
                raise OSError(errno.ENOSPC, "short write: the run directory's file system is full")
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)

    def enter(self, info: dict[str, Any]) -> None:
        data = strictjson.dumps(info, separators=(",", ":")).encode()[: SIZE - 5]
        self._mm[0] = EMPTY  # never a half-written payload marked as valid
        self._mm[1:5] = len(data).to_bytes(4, "little")
        self._mm[5:5 + len(data)] = data
        self._mm[0] = INSIDE

    def leave(self) -> None:
        self._mm[0] = FINISHED

    def fail(self) -> None:
        self._mm[0] = FAILED


def read_inflight(path: Path) -> tuple[str, dict[str, Any] | None]:
    """(SLOT_INSIDE | SLOT_FINISHED | SLOT_FAILED | SLOT_EMPTY, the last collective's info)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return SLOT_EMPTY, None
    if len(raw) < 5 or raw[0] == EMPTY:
        return SLOT_EMPTY, None
    n = int.from_bytes(raw[1:5], "little")
    try:
        info = strictjson.loads(raw[5:5 + n])
    except ValueError:
        return SLOT_EMPTY, None
    return {INSIDE: SLOT_INSIDE, FAILED: SLOT_FAILED}.get(raw[0], SLOT_FINISHED), info

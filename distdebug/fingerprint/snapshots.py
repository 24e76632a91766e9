"""Per-rank fingerprint snapshots in the run directory, so that every check can be redone offline.

``rank-N/fingerprints.bin`` is append-only; each record is one ``write()``:
    int64 step | int32 names id | int32 count | count x uint64 fingerprints
``rank-N/fingerprint-names.json`` holds the name lists (``{"v": 1, "names": [[...], ...]}``); a record
refers to one by index, so 2000 names are stored once, not at every step. Binary, because an
offline diff of thousands of ranks must load in seconds (numpy reads it directly).
"""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import numpy as np

from distdebug.artifacts import layout
from distdebug.artifacts.writer import os_error_text

_HEAD = struct.Struct("<qii")


class SnapshotWriter:
    """Appends a rank's fingerprints. A full or failing disk stops the snapshots, never the check: the
    first failure is said once (``stopped``: the step and why), the file cut back to its last whole
    record so that ``diff`` still reads every step before it, and nothing more is written."""

    def __init__(self, rank_dir: Path) -> None:
        rank_dir.mkdir(parents=True, exist_ok=True)
        self.names_path = rank_dir / layout.FINGERPRINT_NAMES
        self._fd = os.open(rank_dir / layout.FINGERPRINTS, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size
        self._lists: list[list[str]] = []
        self._ids: dict[tuple[str, ...], int] = {}
        self.stopped: tuple[int, str] | None = None
        """(the first step not written, why) once a write failed."""

    def write(self, step: int, fps: dict[str, int]) -> None:
        if self.stopped is not None:
            return
        try:
            self._write(step, fps)
        except OSError as e:
            self.stopped = (step, os_error_text(e))
            try:
                os.ftruncate(self._fd, self._size)  # a cut record would misalign every later read
            except OSError:
                pass  # parse_records drops a record cut at the end
            self.close()

    def _write(self, step: int, fps: dict[str, int]) -> None:
        names = tuple(fps)
        nid = self._ids.get(names)
        if nid is None:
            nid = self._ids[names] = len(self._lists)
            self._lists.append(list(names))
            tmp = self.names_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"v": 1, "names": self._lists}))
            os.replace(tmp, self.names_path)
        values = np.fromiter((fps[n] for n in names), dtype=np.uint64, count=len(names))
        data = _HEAD.pack(step, nid, len(names)) + values.tobytes()
        if os.write(self._fd, data) != len(data):
            raise OSError(errno.ENOSPC, "short write (the file system is full)")
        self._size += len(data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def parse_records(data: bytes, lists: list[list[str]]) -> dict[int, tuple[list[str], np.ndarray]]:
    """step -> (names, uint64 fingerprints) from a fingerprints.bin; a record cut short by a kill is dropped."""
    out: dict[int, tuple[list[str], np.ndarray]] = {}
    pos = 0
    while pos + _HEAD.size <= len(data):
        step, nid, count = _HEAD.unpack_from(data, pos)
        pos += _HEAD.size
        end = pos + 8 * count
        if end > len(data) or nid >= len(lists):
            break
        out[step] = (lists[nid], np.frombuffer(data, dtype=np.uint64, count=count, offset=pos))
        pos = end
    return out


def read_snapshots(rank_dir: Path) -> dict[int, tuple[list[str], np.ndarray]]:
    """One rank's snapshots: step -> (names, uint64 fingerprints)."""
    try:
        lists = json.loads((rank_dir / layout.FINGERPRINT_NAMES).read_text())["names"]
        data = (rank_dir / layout.FINGERPRINTS).read_bytes()
    except (FileNotFoundError, ValueError, KeyError):
        return {}
    return parse_records(data, lists)

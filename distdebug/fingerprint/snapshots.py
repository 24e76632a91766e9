"""Per-rank fingerprint snapshots in the run directory, so that every check can be redone offline.

``rank-N/fingerprints.bin`` is append-only; each record is one ``write()``:
    int64 step | int32 names id | int32 count | count x uint64 fingerprints
``rank-N/fingerprint-names.json`` holds the name lists (``{"v": 1, "names": [[...], ...]}``); a record
refers to one by index, so 2000 names are stored once, not at every step. Binary, because an
offline diff of thousands of ranks must load in seconds (numpy reads it directly).

Within a run-directory budget (artifacts.retention) the file rotates like the events: the first segment
and the newest kept whole, the steps around each finding kept in ``fingerprints.thinned.bin``, and every
other step of a segment leaving the ring reduced to one digest of all its tensors in
``fingerprint-roots.bin`` (``int64 step | uint64 digest``): enough to tell whether ranks (or runs) agreed at
that step, not on which tensor.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import numpy as np
import xxhash

from distdebug.artifacts import layout, retention
from distdebug.artifacts.writer import append_whole, os_error_text, replace_whole

_HEAD = struct.Struct("<qii")
_ROOT = np.dtype([("step", "<i8"), ("names", "<i4"), ("count", "<i4"), ("root", "<u8")])
assert _ROOT.itemsize == layout.FINGERPRINT_ROOT_BYTES


class SnapshotWriter:
    """Appends a rank's fingerprints. A full or failing disk stops the snapshots, never the check: the
    first failure is said once (``stopped``: the step and why), the file cut back to its last whole
    record so that ``diff`` still reads every step before it, and nothing more is written.

    With a ``share`` of the run-directory budget it rotates and thins (module docstring); ``pins`` are the
    steps kept whole (each finding's neighbourhood: the detector feeds it every finding of the rank)."""

    def __init__(self, rank_dir: Path, share: retention.Share | None = None) -> None:
        rank_dir.mkdir(parents=True, exist_ok=True)
        self.names_path = rank_dir / layout.FINGERPRINT_NAMES
        self.path = rank_dir / layout.FINGERPRINTS
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size
        self._lists: list[list[str]] = _read_lists(rank_dir)  # a restarted rank keeps the ids its records use
        self._ids: dict[tuple[str, ...], int] = {tuple(n): i for i, n in enumerate(self._lists)}
        self.share = share
        self.pins = retention.Pins()
        if share is not None:  # a restarted rank: the findings of its earlier attempts still pin their steps
            retention.recover_pins(self.pins, rank_dir / layout.EVENTS)
        self._rotation = retention.Rotation(self.path, share.ring) if share is not None else None
        self.thinner = retention.Thinner(lambda: self._thin(share), "distdebug-thin-fingerprints") \
            if share is not None else None
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
            self.close(settle=False)  # on the training thread: never wait for the thinner here

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
        if self.share is not None and self._size > self.share.segment:
            self._rotate()

    def _rotate(self) -> None:
        assert self._rotation is not None and self.share is not None
        try:
            self._rotation.rotate()
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            self._rotation = self.share = None  # the segment (renamed or not) goes on: nothing lost
            return
        old, self._fd, self._size = self._fd, fd, 0
        try:
            os.close(old)
        except OSError:
            pass
        if self.thinner is not None:
            self.thinner.after_rotation(self._rotation)

    def _thin(self, share: retention.Share) -> None:
        """On the thinner's thread: each segment past the ring to its pinned records and its steps' digests."""
        thinned, roots = layout.thinned_path(self.path), self.path.parent / layout.FINGERPRINT_ROOTS
        for seg in retention.Rotation(self.path, share.ring).leaving_ring():
            try:
                data = seg.read_bytes()
                kept, digests = [], []
                room = share.thinned - (thinned.stat().st_size if thinned.exists() else 0)
                for step, nid, count, start, end in _spans(data):
                    if self.pins.covers(step) and end - start <= room:
                        kept.append(data[start:end])
                        room -= end - start
                    else:
                        digests.append((step, nid, count, root(data[start + _HEAD.size:end])))
                size = thinned.stat().st_size if thinned.exists() else 0
                append_whole(thinned, b"".join(kept))
                try:
                    append_whole(roots, np.array(digests, dtype=_ROOT).tobytes())
                except OSError:
                    os.truncate(thinned, size)  # both or neither: the segment is thinned again next time
                    raise
            except OSError:
                return
            try:
                if roots.stat().st_size > share.roots:
                    replace_whole(roots, halve(read_roots_file(roots)).tobytes())
            except OSError:
                pass
            try:
                seg.unlink()
            except OSError:
                return

    def close(self, settle: bool = True) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if settle and self.thinner is not None:
            self.thinner.stop(5.0)  # the rank's end waits for the thinning in hand, a few seconds at most


def root(values: bytes) -> int:
    """One digest of a step's fingerprints (all its tensors, in the record's order)."""
    return xxhash.xxh64_intdigest(values)


def halve(table: np.ndarray) -> np.ndarray:
    """The digests of every other step by step number (the steps whose number is a multiple of the next power
    of two that keeps half or fewer): every rank of a job keeps the same steps, whatever its pins."""
    k = 1
    while True:
        kept = table[table["step"] % (1 << k) == 0]
        if len(kept) * 2 <= len(table) or k > 62:
            return kept
        k += 1


def _spans(data: bytes) -> list[tuple[int, int, int, int, int]]:
    """(step, names id, count, start, end) of each whole record of a fingerprints file."""
    out = []
    pos = 0
    while pos + _HEAD.size <= len(data):
        step, nid, count = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + 8 * count
        if end > len(data):
            break
        out.append((step, nid, count, pos, end))
        pos = end
    return out


def _read_lists(rank_dir: Path) -> list[list[str]]:
    try:
        lists = json.loads((rank_dir / layout.FINGERPRINT_NAMES).read_text())["names"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return lists if isinstance(lists, list) else []


def read_roots_file(path: Path) -> np.ndarray:
    """A roots file as a (step, root) table; a record cut by a kill is dropped."""
    try:
        data = path.read_bytes()
    except OSError:
        return np.zeros(0, dtype=_ROOT)
    return np.frombuffer(data[:len(data) - len(data) % _ROOT.itemsize], dtype=_ROOT).copy()


def read_roots(rank_dir: Path, lists: list[list[str]] | None = None) -> dict[int, tuple[tuple[str, ...], int]]:
    """step -> (the names it digested, the digest of all their fingerprints), for the steps thinned to one."""
    lists = _read_lists(rank_dir) if lists is None else lists
    table = read_roots_file(rank_dir / layout.FINGERPRINT_ROOTS)
    return {int(step): (tuple(lists[nid]) if 0 <= nid < len(lists) else (), int(r))
            for step, nid, r in zip(table["step"].tolist(), table["names"].tolist(), table["root"].tolist(),
                                    strict=True)}


def read_stream(rank_dir: Path, lists: list[list[str]]) -> dict[int, tuple[list[str], np.ndarray]]:
    """Every step a rank's fingerprint files hold whole (head, thinned, ring, live): step -> (names, values)."""
    out: dict[int, tuple[list[str], np.ndarray]] = {}
    for path in layout.stream_files(rank_dir / layout.FINGERPRINTS):
        try:
            out.update(parse_records(path.read_bytes(), lists))
        except OSError:
            continue
    return out


def parse_records(data: bytes, lists: list[list[str]]) -> dict[int, tuple[list[str], np.ndarray]]:
    """step -> (names, uint64 fingerprints) from a fingerprints.bin; a record cut short by a kill is dropped."""
    out: dict[int, tuple[list[str], np.ndarray]] = {}
    for step, nid, count, start, _ in _spans(data):
        if nid >= len(lists):
            break
        out[step] = (lists[nid], np.frombuffer(data, dtype=np.uint64, count=count, offset=start + _HEAD.size))
    return out


def read_snapshots(rank_dir: Path) -> dict[int, tuple[list[str], np.ndarray]]:
    """One rank's snapshots: step -> (names, uint64 fingerprints)."""
    lists = _read_lists(rank_dir)
    return read_stream(rank_dir, lists) if lists else {}

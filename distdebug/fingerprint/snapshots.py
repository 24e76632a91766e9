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
_BLOCK = struct.Struct("<qqiiqqiq")
"""A record of fingerprint-blocks.bin: first step | last step | names id | tensors | width | steps | the segment
number and offset in fingerprints.bin where the steps no block covers begin (the flush that wrote it); then a
uint64 digest per tensor."""
BLOCKS_PART = 32
"""The blocks file's cap is this fraction (1/32) of the fingerprints' share: a 1,000-tensor model's 1.3 M steps
are 10 MB of blocks, 6 MiB at the default budget (merged once)."""
BLOCK = 1024
"""Steps per block (aligned on step numbers: every rank cuts the same blocks), before blocks merge under their
file's cap (the width doubles)."""
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
        self.blocks = BlockWriter(rank_dir / layout.FINGERPRINT_BLOCKS,
                                  share.total // BLOCKS_PART if share is not None else None)
        self.blocks.recover(rank_dir, self._lists, self._position())

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
        values = np.fromiter(fps.values(), dtype=np.uint64, count=len(names))  # the names' order
        data = _HEAD.pack(step, nid, len(names)) + values.tobytes()
        before = self._position()
        if os.write(self._fd, data) != len(data):
            raise OSError(errno.ENOSPC, "short write (the file system is full)")
        self._size += len(data)
        if self.share is not None and self._size > self.share.segment:
            self._rotate()
        self.blocks.add(step, nid, values, before)

    def _position(self) -> tuple[int, int]:
        """Where the next record goes: (the live file's segment number once rotated, its size)."""
        return (self._rotation.next if self._rotation is not None else 0), self._size

    def _rotate(self) -> None:
        assert self._rotation is not None and self.share is not None
        try:
            self._rotation.rotate()
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            self._rotation = self.share = None  # the segment (renamed or not) goes on: nothing lost
            self.blocks.on = False  # positions by segment number end here: diff reads on from the last block
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
            self.blocks.close(self._position())
            os.close(self._fd)
            self._fd = -1
        if settle and self.thinner is not None:
            self.thinner.stop(5.0)  # the rank's end waits for the thinning in hand, a few seconds at most


class BlockWriter:
    """A rank's fingerprint blocks (issue 48, reading at scale): per block of BLOCK steps and tensor, the sum
    over the block's steps of a 64-bit mix of the step and the tensor's fingerprint (``mix``). Two ranks that
    agree on a tensor at every step of a block have the same sum; a sum, so that blocks merge by adding when
    the file passes its cap (``cap``: the width doubles; every rank of a job merges alike). ``distdebug diff``
    compares blocks to find the first one where ranks differ, then reads one rank per distinct block and only
    that block's steps (analysis.diff). Each names list (a tensor set) has blocks of its own: a detector that
    alternates two lists keeps two blocks open, one per list.

    Never in the way: a failure (a full disk), or a file that merging cannot bring under its cap, turns the
    blocks off (``on``); diff then reads the steps after the last block from the stream, as for a killed rank."""

    def __init__(self, path: Path, cap: int | None) -> None:
        self.path = path
        self.cap = cap
        self.on = True
        self.width = BLOCK
        self._open: dict[int, list] = {}  # names id -> [key, first, last, steps, acc]
        self._size = 0
        self._existed = path.exists()
        """The file was there before this writer: blocks were kept for this stream (an empty file included: a
        stream whose first block was never flushed), as opposed to a stream from before blocks."""
        self._found: list[Block] = []
        """The blocks the file held at open (a restarted rank's): ``recover`` starts from them."""
        try:
            if not self._existed:
                path.touch()  # the marker: this stream has blocks, even before its first flush
            self._size = path.stat().st_size
            if self._size:
                self._found = read_blocks_file(path)
                self.width = max([BLOCK] + [b.width for b in self._found])
        except OSError:
            self._size = 0

    def recover(self, rank_dir: Path, lists: list[list[str]], end: tuple[int, int]) -> None:
        """A restarted rank: the steps its killed attempt wrote after its last flush (in no block, and before
        where this attempt's blocks will say the uncovered steps begin) made into blocks now; a stream with no
        blocks of its own (an older version's) or whose steps after them were thinned: blocks off."""
        if not self.on:
            return
        try:
            blocks, self._found = self._found, []
            if not blocks and end == (0, 0) and not layout.segments(rank_dir / layout.FINGERPRINTS):
                return  # a new stream
            if not blocks and not self._existed:
                self.on = False  # a stream from before blocks: diff reads it whole
                return
            seg, offset = max(((b.seg, b.offset) for b in blocks), default=(0, 0))  # none yet: from the start
            tail = read_after(rank_dir, lists, seg, offset)
            if tail is None:
                self.on = False
            elif tail:
                data = b"".join(b.pack() for b in blocks_of(tail, lists, self.width, end))
                append_whole(self.path, data)
                self._size += len(data)
        except (OSError, ValueError, struct.error):
            self.on = False

    def add(self, step: int, nid: int, values: np.ndarray, before: tuple[int, int]) -> None:
        """Step ``step``'s fingerprints (names list ``nid``), written to the stream at ``before`` (its segment
        number and offset). A new key (the next block), a list whose length changed, or a step that does not
        follow its list's last (a restart) closes every open block: each block record then says where in the
        stream the steps no block covers begin (``before``), so that a reader reads only those."""
        if not self.on:
            return
        key = step // self.width
        cur = self._open.get(nid)
        if self._open and (cur is not None and (len(cur[4]) != len(values) or step <= cur[2])
                           or any(c[0] != key for c in self._open.values())):
            self._flush(before)
            cur = None
        if cur is None:
            cur = self._open[nid] = [key, step, step, 0, np.zeros(len(values), dtype=np.uint64)]
        np.add(cur[4], mix(values, step), out=cur[4])
        cur[2], cur[3] = step, cur[3] + 1

    def _flush(self, position: tuple[int, int]) -> None:
        opened, self._open = self._open, {}
        if not opened or not self.on:
            return
        seg, offset = position
        data = b"".join(_BLOCK.pack(first, last, nid, len(acc), self.width, steps, seg, offset) + acc.tobytes()
                        for nid, (_, first, last, steps, acc) in sorted(opened.items(), key=lambda x: x[1][1]))
        try:
            append_whole(self.path, data)
            self._size += len(data)
            if self.cap is not None and self._size > self.cap:
                blocks = read_blocks_file(self.path)
                merged = merge_blocks(blocks, self.width * 2)
                if len(merged) * 4 > len(blocks) * 3:  # merging no longer halves it: blocks stop here
                    self.on = False
                    return
                self.width *= 2
                blob = b"".join(b.pack() for b in merged)
                replace_whole(self.path, blob)
                self._size = len(blob)
        except (OSError, ValueError, struct.error):
            self.on = False

    def close(self, position: tuple[int, int]) -> None:
        self._flush(position)


def mix(values: np.ndarray, step: int) -> np.ndarray:
    """A step's term of a block's digest, per tensor: the fingerprint xor a mix of the step, times an odd
    constant (mod 2**64). Each is a bijection, so a fingerprint that differs at one step always changes the
    block's sum; the step's mix keeps a fingerprint seen at another step, or two swapped between steps, from
    cancelling out. Three vector operations: a few microseconds a step for 1,000 tensors."""
    return (values ^ np.uint64(_splitmix(step))) * np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


class Block:
    """One record of fingerprint-blocks.bin."""

    __slots__ = ("first", "last", "nid", "width", "steps", "seg", "offset", "acc")

    def __init__(self, first: int, last: int, nid: int, width: int, steps: int, seg: int, offset: int,
                 acc: np.ndarray) -> None:
        self.first, self.last, self.nid, self.width, self.steps = first, last, nid, width, steps
        self.seg, self.offset, self.acc = seg, offset, acc

    @property
    def key(self) -> int:
        return self.first // self.width

    def pack(self) -> bytes:
        return _BLOCK.pack(self.first, self.last, self.nid, len(self.acc), self.width, self.steps, self.seg,
                           self.offset) + self.acc.tobytes()


def read_blocks_file(path: Path) -> list[Block]:
    """A rank's blocks in the order written; a record cut at the end (a kill) is dropped. OSError when there is
    no file."""
    data = path.read_bytes()
    out = []
    pos = 0
    while pos + _BLOCK.size <= len(data):
        first, last, nid, count, width, steps, seg, offset = _BLOCK.unpack_from(data, pos)
        end = pos + _BLOCK.size + 8 * count
        if end > len(data) or width <= 0 or count < 0:
            break
        out.append(Block(first, last, nid, width, steps, seg, offset,
                         np.frombuffer(data, dtype=np.uint64, count=count, offset=pos + _BLOCK.size)))
        pos = end
    return out


def blocks_of(steps: dict[int, tuple[list[str], np.ndarray]], lists: list[list[str]], width: int,
              position: tuple[int, int] = (0, 0)) -> list[Block]:
    """Blocks of steps no block covers (a killed attempt's last ones), as the writer would have made them:
    per names list and key."""
    ids = {tuple(n): i for i, n in enumerate(lists)}
    out: dict[tuple[int, int, int], Block] = {}
    for step in sorted(steps):
        names, values = steps[step]
        k = (ids.get(tuple(names), -1), step // width, len(values))
        b = out.get(k)
        if b is None:
            b = out[k] = Block(step, step, k[0], width, 0, position[0], position[1],
                               np.zeros(len(values), dtype=np.uint64))
        np.add(b.acc, mix(values, step), out=b.acc)
        b.last, b.steps = step, b.steps + 1
    return list(out.values())


def merge_blocks(blocks: list[Block], width: int) -> list[Block]:
    """Blocks at ``width`` (a multiple of theirs): those of one names list and one key summed, in the order of
    their first block; a block whose steps do not follow its list's last (a restarted rank's) is kept apart."""
    out: list[Block] = []
    at: dict[tuple[int, int], int] = {}  # (names id, key) -> its place in out
    last: dict[int, int] = {}  # names id -> the last step summed for it
    for b in blocks:
        k = (b.nid, b.first // width)
        i = at.get(k)
        if i is not None and len(out[i].acc) == len(b.acc) and b.first > last[b.nid]:
            m = out[i]
            out[i] = Block(m.first, b.last, b.nid, width, m.steps + b.steps, b.seg, b.offset, m.acc + b.acc)
        else:
            at[k] = len(out)
            out.append(Block(b.first, b.last, b.nid, width, b.steps, b.seg, b.offset, b.acc.copy()))
        last[b.nid] = max(last.get(b.nid, b.last), b.last)
    return out


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
        if count < 0 or end > len(data):  # a damaged record (a negative count would never move on): stop there
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


def read_after(rank_dir: Path, lists: list[list[str]], seg: int, offset: int) \
        -> dict[int, tuple[list[str], np.ndarray]] | None:
    """The steps a rank's fingerprint stream holds after a position (a block's ``seg``/``offset``: the steps no
    block covers yet, a killed rank's last ones); None when a file the position needs is gone (thinned)."""
    live = rank_dir / layout.FINGERPRINTS
    segs = dict(layout.segments(live))
    done = max(segs) + 1 if segs else 0
    if seg > done:
        return None
    files = [(segs.get(n), offset if n == seg else 0) for n in range(seg, done)]
    files.append((live, offset if seg == done else 0))
    out: dict[int, tuple[list[str], np.ndarray]] = {}
    for path, start in files:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                f.seek(start)
                out.update(parse_records(f.read(), lists))
        except OSError:
            if path != live:
                return None
    return out


def read_snapshots(rank_dir: Path) -> dict[int, tuple[list[str], np.ndarray]]:
    """One rank's snapshots: step -> (names, uint64 fingerprints)."""
    lists = _read_lists(rank_dir)
    return read_stream(rank_dir, lists) if lists else {}

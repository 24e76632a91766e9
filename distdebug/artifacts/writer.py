"""Append-only JSON Lines writer for one rank's event stream.

Why ``os.write`` on an ``O_APPEND`` descriptor and no background thread: each record is one
small write into the page cache (microseconds, never a disk flush), and whatever was written
survives a SIGKILL of the rank, because the kernel already holds it. A queue drained by a thread
would lose its backlog exactly when a rank is killed, which is when the records matter most.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from distdebug import strictjson
from distdebug.artifacts import layout, retention, schema
from distdebug.artifacts.redact import Redactor

RESERVE = 64 * 1024
"""Bytes a rank's event writer holds back on disk (a file of its own, given back at need), so that when the
disk fills its findings, a stall and its end record still fit."""
LAST = 16 * 1024
"""The part of the reserve only a stall and the end may take: many findings, or a long evaluation's repeated
stall warnings, never use up the room of a real hang's stall record or of the end record."""
LAST_KINDS = frozenset({schema.STALL, schema.END})
INDEX_EVERY = 256
"""Records between two saves of a rank's index: a reader reads at most this many records past it (a killed rank's
tail), and a save (a few tens of KB, written aside and renamed) costs the writing thread about a microsecond a
record."""
ESSENTIAL_PART = 1 / 8
"""The essential file's part of the events' share of the budget; past it the index stops (stays as last saved:
readers read the stream past it, whole and slower, never wrong)."""


def os_error_text(e: OSError) -> str:
    """``ENOSPC: No space left on device``: a failed write's error name and text, for the one line that says it."""
    return f"{errno.errorcode.get(e.errno or 0, type(e).__name__)}: {e.strerror or e}"


class EventWriter:
    """Writes one record per line; thread-safe; never raises into training after open.

    A full or failing disk (ENOSPC, EIO, a read-only file system) never reaches the training: at the first
    failed write the writer says so once on stderr, gives back its reserve, writes a ``write_failed``
    record, and from then on writes only the essential records (``schema.ESSENTIAL``: findings, stalls,
    the end), each taking a little of the reserve if the disk is still full. What was written stays
    readable: a cut line is skipped by every reader.

    With a ``share`` of the run-directory budget the stream is kept in tiers (artifacts.retention): the live
    file is renamed to a segment when it reaches ``share.segment`` bytes, and a segment leaving the ring is
    thinned (its steps summarised but those around a finding) on the writing thread: one rename a segment,
    and a small read and append when one leaves the ring.
    """

    def __init__(self, path: Path, reserve: int = 0, label: str = "",
                 share: retention.Share | None = None, index: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        st = os.fstat(self._fd)
        self._size, self._ino = st.st_size, st.st_ino
        self.share = share
        self.pins = retention.Pins()
        """Each finding's neighbourhood: kept whole when its segment is thinned."""
        self._rotation: retention.Rotation | None = None
        self.thinner: retention.Thinner | None = None
        if share is not None:
            self._rotation = retention.Rotation(path, share.ring)
            self.thinner = retention.Thinner(lambda: self._thin(share), f"distdebug-thin-{path.parent.name}")
            retention.recover_pins(self.pins, path)
        self._lock = threading.Lock()
        self._redact = Redactor()  # secrets never land in the run directory (artifacts.redact)
        self.indexer: Indexer | None = None
        if index:
            self.indexer = Indexer(path, int(share.total * ESSENTIAL_PART) if share is not None else None)
            self.indexer.resume(self._position())
        self.failed_writes = 0
        self.degraded = False
        """Writes failed once: only the essential records are written from then on."""
        self.label = label or str(path)
        self._cut = self._size > 0 and _last_byte(path) != b"\n"  # an earlier attempt's line the disk cut
        self._last_step: int | None = None  # the step of the last record written that had one
        self._reserve: Path | None = None
        if reserve:
            self._reserve = layout.reserve_path(path)
            try:
                self._reserve.write_bytes(bytes(reserve))
            except OSError:  # no room for it: the disk is nearly full already; writes fail and say so
                self._give_back(0)

    def write(self, record: dict) -> None:
        line = (self._redact(strictjson.dumps(record, separators=(",", ":"), default=str)) + "\n").encode()
        with self._lock:
            if self._fd is None:
                return
            if self.degraded and record.get("kind") not in schema.ESSENTIAL:
                self.failed_writes += 1  # dropped: the smallest tier keeps only what matters
                return
            error = self._write(line)
            if error is None:
                if self.indexer is not None:
                    self.indexer.note(record, line, self._position)
                if isinstance(record.get("step"), int):
                    self._last_step = record["step"]
                    if record.get("kind") == schema.FINDING:
                        self.pins.add(record["step"])
                if self.share is not None and self._size > self.share.segment:
                    self._rotate()
                return
            if not self.degraded:
                self._degrade(error, record)
            floor = 0 if record.get("kind") in LAST_KINDS else LAST
            if record.get("kind") in schema.ESSENTIAL and self._give_back(len(line) + 4096, floor) \
                    and self._write(line) is None:
                if self.indexer is not None:
                    self.indexer.note(record, line, self._position)
                return  # the reserve made room for an essential record
            self.failed_writes += 1

    def _write(self, line: bytes) -> OSError | None:
        assert self._fd is not None
        if self._cut:  # the last record was cut by a full disk: end its line, or this one joins it
            line = b"\n" + line
        try:
            # One write() per record: with O_APPEND, concurrent records never interleave.
            n = os.write(self._fd, line)
        except OSError as e:
            return e
        self._size += n
        if n >= len(line) - 1:  # whole (a record cut just before its newline is whole too: never written twice)
            self._cut = n < len(line)
            return None
        if n > 0 and self.indexer is not None:
            self.indexer.damaged += 1  # a cut line: every reader skips it, and counts it
        self._cut = n > 0 or self._cut
        return OSError(errno.ENOSPC, "short write (the file system is full)")

    def _rotate(self) -> None:
        """Under the lock: the live file becomes the next segment and a new one begins; the segments leaving
        the ring are thinned. A rename or open that fails leaves the writer on the file it has (rotation off:
        the disk's trouble is the writes' to say)."""
        assert self._rotation is not None and self._fd is not None
        if self._cut:  # the disk cut the last record before its newline: end it, or readers drop it
            try:
                os.write(self._fd, b"\n")
            except OSError:
                pass
        try:
            self._rotation.rotate()  # renaming an open file: this descriptor follows it until closed
        except OSError:
            self._rotation_off()
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            self._rotation_off()  # go on writing into the segment: nothing is lost
            return
        old, self._fd, self._size, self._cut = self._fd, fd, 0, False
        self._ino = os.fstat(fd).st_ino
        try:
            os.close(old)
        except OSError:  # a deferred write error (NFS): the segment keeps what reached it
            pass
        if self.indexer is not None:
            self.indexer.save(self._position())
        if self.thinner is not None:
            self.thinner.after_rotation(self._rotation)

    def _thin(self, share: retention.Share) -> None:
        """On the thinner's thread: each segment past the ring into the thinned file, then deleted; the thinned
        file brought under its cap. A failed append is undone (cut back to the size before it) and the segment
        left where it is, thinned at the next rotation: a segment is never thinned twice."""
        from distdebug.artifacts.reader import read_events, read_json

        thinned = layout.thinned_path(self.path)
        stats_path = self.path.with_name(layout.THINNED_STATS)
        for seg in retention.Rotation(self.path, share.ring).leaving_ring():
            try:
                records, _ = read_events(seg)
                out = retention.thin_events(records, self.pins.covers)
                append_whole(thinned, b"".join(_line(r) for r in out))
            except OSError:
                return
            before = read_json(stats_path)
            try:  # (none yet, or a write of it failed: counted again from the whole thinned file, within its cap)
                stats = retention.window_stats(out, before) if before is not None else \
                    retention.window_stats(read_events(thinned)[0])
            except OSError:
                stats = None
            try:
                if thinned.stat().st_size > share.thinned:
                    kept, _ = read_events(thinned)
                    fitted = retention.fit_thinned(kept, share.thinned)
                    replace_whole(thinned, b"".join(_line(r) for r in fitted))
                    stats = retention.window_stats(fitted)
            except OSError:
                pass  # over its cap until the next thinning: nothing lost, nothing twice
            try:
                if stats is None:
                    raise OSError("not counted")
                replace_whole(stats_path, strictjson.dumps(stats).encode())
            except OSError:
                try:  # never stale: without it the next thinning counts again, and a report reads the records
                    stats_path.unlink(missing_ok=True)
                except OSError:
                    pass
            try:
                seg.unlink()
            except OSError:
                return

    def _degrade(self, error: OSError, lost: dict) -> None:
        """The first failure: say it once, give back the reserve, record what happened (essential)."""
        self.degraded = True
        if self.indexer is not None:  # the index stays as last saved: readers read what follows from the stream
            self.indexer.stop()
        reason = os_error_text(error)
        try:
            print(f"distdebug: {self.label}: writing the run directory failed ({reason}); from here on only "
                  "findings, stalls and the end are kept; the training goes on", file=sys.stderr, flush=True)
        except Exception:  # stderr on the same full disk
            pass
        self._give_back(8192, LAST)  # room for this record; the rest stays held for the essential ones
        step = lost.get("step") if isinstance(lost.get("step"), int) else self._last_step
        rec = schema.record(schema.WRITE_FAILED, rank=lost.get("rank"), step=step, error=reason,
                            lost=lost.get("kind"), time=time.time())
        if self._write(_line(rec)) is not None:
            self.failed_writes += 1

    def _give_back(self, size: int, floor: int = 0) -> bool:
        """Shrink the reserve by ``size`` bytes (0: all of it), never below ``floor``; whether any was given."""
        if self._reserve is None:
            return False
        try:
            held = self._reserve.stat().st_size
            left = max(floor, held - size) if size else 0
            if left >= held:
                return False
            if left:
                os.truncate(self._reserve, left)
            else:
                self._reserve.unlink()
                self._reserve = None
            return True
        except OSError:
            self._reserve = None
            return False

    def _rotation_off(self) -> None:
        """A rename or open that failed: the writer stays on the file it has, and positions in the stream can no
        longer be told by segment number: the index stops where it was last saved (readers read on from there)."""
        self._rotation = self.share = None
        if self.indexer is not None:
            self.indexer.stop()

    def _position(self) -> tuple[int, int, int]:
        """Where the next record goes: (the live file's segment number once rotated, its size, its inode)."""
        return (self._rotation.next if self._rotation is not None else 0), self._size, self._ino

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                if self._cut:  # the disk cut the last record before its newline: end it, or readers drop it
                    try:
                        os.write(self._fd, b"\n")
                    except OSError:
                        pass
                if self.indexer is not None:
                    self.indexer.close(self._position())
                os.close(self._fd)
                self._fd = None
            self._give_back(0)
        if self.thinner is not None:
            self.thinner.stop(5.0)  # a rank's end waits for the thinning in hand, a few seconds at most


class Indexer:
    """A rank's index of its event stream (issue 48, reading at scale), kept by its writer as it writes: every
    record but the per-step ones appended to ``essential.jsonl`` with its position in the stream (``"i"``), and
    every INDEX_EVERY records (and at each rotation, and at the end) ``index.json``: the stream position it
    covers (segment number, offset, inode), the essential file's size then, and the digest of every record up
    to there (artifacts.digest). A reader reads these and the stream past the position: a few hundred records,
    not the run (artifacts.reader.load_rank).

    Never in the way: any failure (a full disk, the essential file past its part of the budget) stops the index
    where it was last saved, which stays right: readers read the stream past it (slower, never wrong). A
    restarted rank (elastic) takes the index up again from what the stream holds past it; a stream with no
    index of its own (written by an older version) stays without one."""

    def __init__(self, live: Path, cap: int | None) -> None:
        from distdebug.artifacts.digest import Digest

        self.live = live
        self.index_path = layout.index_path(live)
        self.essential_path = layout.essential_path(live)
        self.cap = cap
        self.on = True
        self.damaged = 0
        """Records the disk cut (their lines are skipped by every reader, and counted)."""
        self.digest = Digest()
        self._since = 0
        self._essential_fd: int | None = None
        self._essential_size = 0

    def resume(self, position: tuple[int, int, int]) -> None:
        """At the writer's open: a new stream starts a new index; one that holds records goes on from its index
        and what follows it (a restarted rank), or goes without when it has none."""
        try:
            fresh = position[:2] == (0, 0) and not layout.segments(self.live)
            if fresh:
                self.index_path.unlink(missing_ok=True)
                self._essential_fd = os.open(self.essential_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
                                             0o644)
                return
            from distdebug.artifacts.reader import indexed_tail

            found = indexed_tail(self.live)
            if found is None:
                self.on = False
                return
            index, tail, follow = found
            if follow.partial:  # a last record the disk cut just before its newline: whole, and this writer ends it
                try:
                    rec = strictjson.loads(follow.partial)
                except ValueError:
                    rec = None
                if isinstance(rec, dict):
                    tail.append(rec)
                    index.damaged -= 1
            self.digest = index.digest
            self.damaged = index.damaged
            self._essential_fd = os.open(self.essential_path, os.O_WRONLY | os.O_APPEND)
            if os.fstat(self._essential_fd).st_size < index.essential_bytes:
                raise ValueError("the essential file is shorter than its index says")
            os.ftruncate(self._essential_fd, index.essential_bytes)  # what followed is in the tail: written again
            self._essential_size = index.essential_bytes
            for r in tail:
                self.note(r, _line(r), None)
            self.save(position)
        except Exception:  # noqa: BLE001 (an unreadable index or stream: this attempt goes without one)
            self.stop()

    def note(self, record: dict, line: bytes, position: Callable[[], tuple[int, int, int]] | None) -> None:
        """A record written whole to the stream (under the writer's lock)."""
        if not self.on:
            return
        seq = self.digest.seq
        try:
            self.digest.feed(record, line[:-1].decode() if record.get("kind") in schema.BULK else None)
            if record.get("kind") not in schema.BULK:
                entry = b'{"i":%d,' % seq + line[1:]
                if self.cap is not None and self._essential_size + len(entry) > self.cap:
                    self.stop()
                    return
                assert self._essential_fd is not None
                if os.write(self._essential_fd, entry) != len(entry):
                    self.stop()
                    return
                self._essential_size += len(entry)
        except Exception:  # noqa: BLE001 (an odd record, a full disk: the index stops, the stream goes on)
            self.stop()
            return
        self._since += 1
        if self._since >= INDEX_EVERY and position is not None:
            self.save(position())

    def save(self, position: tuple[int, int, int]) -> None:
        if not self.on:
            return
        self._since = 0
        nxt, offset, ino = position
        head = strictjson.dumps({"v": 1, "pos": {"next": nxt, "offset": offset, "ino": ino},
                           "essential_bytes": self._essential_size, "damaged": self.damaged})
        try:
            # The digest's records are their lines as written (redacted); the rest is numbers.
            replace_whole(self.index_path, f'{head[:-1]},"digest":{self.digest.dumps()}}}'.encode())
        except Exception:  # noqa: BLE001 (a full disk, a value JSON cannot hold: the index stops, never the rank)
            self.stop()

    def stop(self) -> None:
        """The index stays as last saved (right, and readers read the stream past it)."""
        self.on = False
        if self._essential_fd is not None:
            try:
                os.close(self._essential_fd)
            except OSError:
                pass
            self._essential_fd = None

    def close(self, position: tuple[int, int, int]) -> None:
        self.save(position)
        self.stop()


def _last_byte(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1)
    except OSError:
        return b"\n"


def _line(record: dict) -> bytes:
    return (strictjson.dumps(record, separators=(",", ":"), default=str) + "\n").encode()


def append_whole(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` whole or not at all: a short or failed write is cut back to the size before."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write (the file system is full)")
        except OSError:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)


def replace_whole(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` now, whole or not at all (written aside and renamed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def append_run_findings(run_dir: Path, findings: list) -> None:
    """Append run-level findings (``Finding`` objects) to the run's findings.jsonl."""
    w = EventWriter(layout.run_findings_path(run_dir))
    for f in findings:
        w.write(schema.record(schema.FINDING, **f.to_dict()))
    w.close()


def write_json_atomic(path: Path, data: dict) -> None:
    """One JSON file (a manifest, a node's record, a stacks request or answer), secrets redacted, written
    aside and renamed: a reader never sees half of it, and a writer killed midway leaves the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(Redactor()(strictjson.dumps(data, indent=2, default=str)))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half file behind
        raise

"""Tolerant readers for run directories, including runs that were killed or are still running."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distdebug import strictjson
from distdebug.artifacts import layout, schema
from distdebug.artifacts.digest import Digest
from distdebug.artifacts.schema import SCHEMA_VERSION


@dataclass
class RankStream:
    """One rank's records; ``damaged_lines`` counts lines that were cut off or unreadable.

    Read whole (``indexed`` False), ``records`` are all the stream holds. Read through the rank's index
    (load_rank), they are every record but the per-step ones, the last RECENT per-step records before the
    index's position and everything after it, in the order written; what the others held is in ``digest``
    (artifacts.digest), which a stream read whole also gives (fed its records): readers of per-step figures
    read ``digest``, never the step records themselves."""

    rank: int
    records: list[dict] = field(default_factory=list)
    damaged_lines: int = 0
    indexed: bool = False
    _digest: Digest | None = None

    @property
    def digest(self) -> Digest:
        if self._digest is None:
            self._digest = Digest()
            for r in self.records:
                self._digest.feed(r)
        return self._digest

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == kind]

    def last_attempt(self) -> list[dict]:
        """Records of the newest attempt (elastic restarts append a new ``start`` record)."""
        starts = [i for i, r in enumerate(self.records) if r.get("kind") == schema.START]
        return self.records[starts[-1]:] if starts else list(self.records)


def read_events(path: Path) -> tuple[list[dict], int]:
    """Parse a JSON Lines file; a final line without newline (a write cut by a kill) is skipped."""
    records: list[dict] = []
    damaged = 0
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return records, damaged
    lines = data.split(b"\n")
    if lines and lines[-1] != b"":
        damaged += 1  # partial last line
    for raw in lines[:-1]:
        if not raw.strip():
            continue
        try:
            rec = strictjson.loads(raw)
        except ValueError:
            damaged += 1
            continue
        if isinstance(rec, dict) and int(rec.get("v", 0)) <= SCHEMA_VERSION:
            records.append(rec)
        else:
            damaged += 1
    return records, damaged


def read_stream(live: Path) -> tuple[list[dict], int]:
    """Every record of a rotated stream (artifacts.retention) in the order written: its head, thinned part,
    ring and live file; the live file alone for a stream that never rotated."""
    records: list[dict] = []
    damaged = 0
    for path in layout.stream_files(live):
        got, bad = read_events(path)
        records += got
        damaged += bad
    return records, damaged


class Follow:
    """The new whole records of a rotated stream since the last ``read``, across its rotations: the first read
    returns what the stream holds already (its segments too). Nothing stays open between reads (``top`` follows
    thousands of ranks). Rotations are told by segment numbers, not inodes (a deleted segment's inode is
    reused): the file being read became segment ``next`` at the first rotation since, and every later segment
    is read whole. A segment thinned before it was read (more rotations than its ring holds between two
    reads: a tiny budget and a fast loop) is a gap: its findings and stalls are in the thinned file."""

    def __init__(self, live: Path) -> None:
        self.live = live
        self.offset = 0
        self.partial = b""
        self.next: int | None = None
        """The number the file being read will have once rotated; None before the first read."""
        self._ino: int | None = None
        self.gaps = 0
        self.damaged = 0
        """Whole lines that did not parse (a line the disk cut, then ended by the next record's write)."""

    @classmethod
    def at(cls, live: Path, next_segment: int, offset: int, ino: int) -> Follow:
        """A follower that has read the stream up to ``offset`` of the file that becomes segment
        ``next_segment`` (a rank's index's position): its first read returns only what came after."""
        f = cls(live)
        f.next, f.offset, f._ino = next_segment, offset, ino
        return f

    def read(self) -> list[dict]:
        for _ in range(3):  # a rotation between opening the live file and listing the segments: again
            try:
                f = open(self.live, "rb")  # noqa: SIM115 (closed below)
            except OSError:
                return self._first([]) if self.next is None else []
            with f:
                st = os.fstat(f.fileno())
                if (self.next is not None and st.st_ino == self._ino and st.st_size >= self.offset
                        and not layout.segment_path(self.live, self.next).exists()):
                    # (no segment ``next`` yet: the file is the one last read, not a new one that took its
                    # inode after several rotations deleted it)
                    f.seek(self.offset)  # the same file as last time: no listing (the supervisor's every poll)
                    data = f.read()
                    self.offset += len(data)
                    return self._lines(data)
                self._ino = st.st_ino
                segs = layout.segments(self.live)
                try:
                    same = os.fstat(f.fileno()).st_ino == self.live.stat().st_ino
                except OSError:
                    same = False
                if not same:
                    continue
                out: list[dict] = []
                done = segs[-1][0] + 1 if segs else 0
                if self.next is None:
                    out = self._first(segs)
                elif done > self.next:  # rotated since the last read
                    out = self._rotated(segs)
                    self.offset, self.partial = 0, b""
                self.next = done
                f.seek(self.offset)
                data = f.read()
            self.offset += len(data)
            return out + self._lines(data)
        return []

    def _first(self, segs: list[tuple[int, Path]]) -> list[dict]:
        out: list[dict] = []
        files = [p for n, p in segs if n == 0] + [layout.thinned_path(self.live)] + [p for n, p in segs if n > 0]
        for path in files:
            out += read_events(path)[0]
        self.next = segs[-1][0] + 1 if segs else 0
        return out

    def _rotated(self, segs: list[tuple[int, Path]]) -> list[dict]:
        """The rest of the file last read (now segment ``next``) and every segment rotated after it, whole."""
        assert self.next is not None
        out: list[dict] = []
        have = dict(segs)
        for n in range(self.next, segs[-1][0] + 1):
            path = have.get(n)
            if path is None:
                self.gaps += 1  # thinned before we read it
                continue
            try:
                with open(path, "rb") as f:
                    if n == self.next:
                        f.seek(self.offset)
                        out += self._lines(f.read())
                        self.partial = b""  # a line the disk cut at the end of the old file: readers skip it
                    else:
                        out += read_events(path)[0]
            except OSError:
                self.gaps += 1
        return out

    def _lines(self, data: bytes) -> list[dict]:
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            try:
                rec = strictjson.loads(line)
            except ValueError:
                self.damaged += bool(line.strip())
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out


@dataclass
class Index:
    """A rank's ``index.json`` (artifacts.writer.Indexer)."""

    next: int
    offset: int
    ino: int
    essential_bytes: int
    damaged: int
    digest: Digest


def read_index(live: Path) -> Index | None:
    data = read_json(layout.index_path(live))
    if data is None or data.get("v") != 1:
        return None
    try:
        pos = data["pos"]
        return Index(int(pos["next"]), int(pos["offset"]), int(pos["ino"]), int(data["essential_bytes"]),
                     int(data.get("damaged") or 0), Digest.from_json(data["digest"]))
    except Exception:  # noqa: BLE001 (any damage: the stream is read whole)
        return None


def indexed_tail(live: Path) -> tuple[Index, list[dict], Follow] | None:
    """A stream's index and the records written after its position; None when it has no index, or one the
    stream no longer matches (a segment thinned before it was indexed, a file shorter than the position)."""
    index = read_index(live)
    if index is None:
        return None
    segs = layout.segments(live)
    done = segs[-1][0] + 1 if segs else 0
    try:
        size = live.stat().st_size
    except OSError:
        size = 0
    if done < index.next or (done == index.next and size < index.offset) or \
            (index.next < done and index.next not in dict(segs)) or \
            (index.next < done and not live.exists()):  # thinned before it was read past; a rotation half done
        return None
    follow = Follow.at(live, index.next, index.offset, index.ino)
    tail = follow.read()
    if follow.gaps:
        return None
    index.damaged += follow.damaged + bool(follow.partial)
    return index, tail, follow


def load_rank(rank: int, folder: Path) -> RankStream:
    """One rank's stream, through its index where it has one that matches (a few hundred records read,
    whatever the run's length), else read whole."""
    live = folder / layout.EVENTS
    got = load_indexed(rank, live)
    if got is not None:
        return got[0]
    records, damaged = read_stream(live)
    return RankStream(rank, records, damaged)


def load_indexed(rank: int, live: Path) -> tuple[RankStream, Follow] | None:
    """A rank's stream read through its index, and a follower of the stream from where that read ended (``top``
    goes on from there); None when the rank has no index that matches its stream."""
    found = indexed_tail(live)
    if found is not None:
        index, tail, follow = found
        try:
            with open(layout.essential_path(live), "rb") as f:
                data = f.read(index.essential_bytes)
        except OSError:
            data = b""
        if len(data) == index.essential_bytes:
            kept: list[tuple[int, dict]] = []
            for raw in data.split(b"\n"):
                try:
                    rec = strictjson.loads(raw) if raw.strip() else None
                except ValueError:
                    rec = None
                if isinstance(rec, dict) and isinstance(rec.get("i"), int):
                    kept.append((rec.pop("i"), rec))
            digest = index.digest
            kept += [(i, dict(r)) for i, r in digest.recent_records()]
            kept.sort(key=lambda x: x[0])
            for r in tail:
                digest.feed(r)
            records = [r for _, r in kept] + [r for r in tail
                                              if isinstance(r, dict) and int(r.get("v", 0)) <= SCHEMA_VERSION]
            return RankStream(rank, records, index.damaged, True, digest), follow
    return None


def read_json(path: Path) -> dict | None:
    try:
        data = strictjson.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class Run:
    path: Path
    manifest: dict | None
    nodes: dict[int, dict]
    ranks: dict[int, RankStream]
    findings: list[dict] = field(default_factory=list)
    """Run-level finding records: the cross-rank verdicts (findings.jsonl) and what each node's launcher found
    before its ranks started (its node file's ``findings``: env_check)."""

    warnings: list[str] = field(default_factory=list)
    """Damage found while reading (an unreadable manifest, skipped lines): said, never silently skipped."""

    paths: list[Path] = field(default_factory=list)
    """Every run directory this run was read from: one, or one per node of a job whose nodes share no file
    system (load_runs); ``path`` is the first."""
    rank_paths: dict[int, Path] = field(default_factory=dict)
    """The run directory that holds each rank's own files (inflight, stacks, Flight Recorder dump)."""

    def dir_of(self, rank: int) -> Path:
        return self.rank_paths.get(rank, self.path)

    def all_findings(self) -> list[dict]:
        """Every finding record: the ranks' own (their last attempt) and the run-level ones."""
        return [r for s in self.ranks.values() for r in s.last_attempt() if r.get("kind") == schema.FINDING] \
            + list(self.findings)


def load_run(run_dir: Path) -> Run:
    """Load everything a run directory holds; missing pieces are simply absent."""
    ranks: dict[int, RankStream] = {}
    for rank, child in layout.rank_dirs(run_dir):
        ranks[rank] = load_rank(rank, child)
    nodes: dict[int, dict] = {}
    for _, f in layout.node_files(run_dir):
        data = read_json(f)
        if data is not None:
            nodes[int(data.get("node_rank", len(nodes)))] = data
    findings, damaged = read_events(layout.run_findings_path(run_dir))
    for _, data in sorted(nodes.items()):  # what each node's launcher found before its ranks started (env_check)
        findings += [f for f in data.get("findings") or () if isinstance(f, dict)]
    warnings = []
    manifest_path = layout.manifest_path(run_dir)
    manifest = read_json(manifest_path)
    if manifest is None and manifest_path.exists():
        warnings.append(f"{layout.MANIFEST} is unreadable: the command and launcher settings are missing below")
    for rank, stream in sorted(ranks.items()):
        if stream.damaged_lines:
            warnings.append(f"rank {rank}: {stream.damaged_lines} unreadable line(s) skipped in {layout.EVENTS}")
    if damaged:
        warnings.append(f"{damaged} unreadable line(s) skipped in {layout.run_findings_path(run_dir).name}")
    return Run(run_dir, manifest, nodes, ranks, findings, warnings, [run_dir], {r: run_dir for r in ranks})


def job_identity(run: Run) -> dict[str, Any]:
    """What every node's run directory of one job shares: the script and its arguments, the number of nodes
    and the rendezvous (backend, address, id). Two directories that differ in any of these are two jobs."""
    m = run.manifest or {}
    launcher = m.get("launcher") or {}
    address = launcher.get("rdzv_endpoint") or (
        f"{launcher.get('master_addr')}:{launcher.get('master_port')}" if launcher.get("master_port") else "")
    return {"script": m.get("target"), "arguments": m.get("target_args"), "nodes": launcher.get("nnodes"),
            "rendezvous": f"{launcher.get('rdzv_backend')} {address} id={launcher.get('rdzv_id')}".strip()}


def _window(run: Run) -> tuple[float, float] | None:
    """When the run's launcher agents ran (the earliest start, the latest end or start), from its nodes' files."""
    starts = [n["started"] for n in run.nodes.values() if isinstance(n.get("started"), (int, float))]
    ends = [n.get("ended") or n["started"] for n in run.nodes.values() if isinstance(n.get("started"), (int, float))]
    return (min(starts), max(e for e in ends if isinstance(e, (int, float)))) if starts else None


def load_runs(paths: list[Path]) -> Run:
    """One run from the run directories of one job's nodes (each node wrote its own: no shared file system).
    Refused with one line (UserError) when they are not one job: a different script, arguments, number of
    nodes or rendezvous, the same rank in two of them, or agents that did not run at the same time."""
    from distdebug.errors import UserError

    runs = [load_run(p) for p in paths]
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    ident = job_identity(first)
    seen: dict[int, Path] = {}
    for other in runs[1:]:
        theirs = job_identity(other)
        differ = [k for k in ident if ident[k] != theirs[k]]
        if differ:
            k = differ[0]
            raise UserError(f"{other.path} is not of the same job as {first.path} ({k}: {theirs[k]!r} against "
                            f"{ident[k]!r}); give the run directories of one job's nodes")
        a, b = _window(first), _window(other)
        if a and b and (b[0] > a[1] + 60 or a[0] > b[1] + 60):
            raise UserError(f"{other.path} is not of the same job as {first.path}: their launchers did not run at "
                            "the same time (the same script and rendezvous, run twice); give one job's directories")
    for run in runs:
        for rank in run.ranks:
            if rank in seen:
                raise UserError(f"rank {rank} is in both {seen[rank]} and {run.path}: these are not the run "
                                "directories of one job's different nodes (the same node twice, or two jobs)")
            seen[rank] = run.path
    manifest = dict(first.manifest or {})
    layout_map: dict[str, Any] = {}
    for run in runs:
        layout_map.update((run.manifest or {}).get("layout") or {})
    manifest["layout"] = layout_map
    manifest["run_dirs"] = [str(r.path) for r in runs]
    findings: list[dict] = []
    for run in runs:  # a verdict each node's supervisor wrote alike is said once
        findings += [f for f in run.findings if f not in findings]
    return Run(first.path, manifest, {k: v for run in runs for k, v in run.nodes.items()},
               {k: v for run in runs for k, v in run.ranks.items()}, findings,
               [f"{run.path.name}: {w}" for run in runs for w in run.warnings],
               [run.path for run in runs], {rank: run.path for run in runs for rank in run.ranks})

"""Tolerant readers for run directories, including runs that were killed or are still running."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from distdebug.artifacts import layout
from distdebug.artifacts.schema import SCHEMA_VERSION


@dataclass
class RankStream:
    """All records of one rank; ``damaged_lines`` counts lines that were cut off or unreadable."""

    rank: int
    records: list[dict] = field(default_factory=list)
    damaged_lines: int = 0

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == kind]

    def last_attempt(self) -> list[dict]:
        """Records of the newest attempt (elastic restarts append a new ``start`` record)."""
        starts = [i for i, r in enumerate(self.records) if r.get("kind") == "start"]
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
            rec = json.loads(raw)
        except ValueError:
            damaged += 1
            continue
        if isinstance(rec, dict) and int(rec.get("v", 0)) <= SCHEMA_VERSION:
            records.append(rec)
        else:
            damaged += 1
    return records, damaged


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
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
    """Run-level finding records (cross-rank verdicts), from findings.jsonl."""

    warnings: list[str] = field(default_factory=list)
    """Damage found while reading (an unreadable manifest, skipped lines): said, never silently skipped."""

    def all_findings(self) -> list[dict]:
        """Every finding record: the ranks' own (their last attempt) and the run-level ones."""
        return [r for s in self.ranks.values() for r in s.last_attempt() if r.get("kind") == "finding"] \
            + list(self.findings)


def load_run(run_dir: Path) -> Run:
    """Load everything a run directory holds; missing pieces are simply absent."""
    ranks: dict[int, RankStream] = {}
    for child in sorted(run_dir.iterdir()):
        rank = layout.rank_of_dir(child.name)
        if rank is None or not child.is_dir():
            continue
        records, damaged = read_events(child / layout.EVENTS)
        ranks[rank] = RankStream(rank, records, damaged)
    nodes: dict[int, dict] = {}
    node_dir = run_dir / "nodes"
    if node_dir.is_dir():
        for f in sorted(node_dir.glob("node-*.json")):
            data = read_json(f)
            if data is not None:
                nodes[int(data.get("node_rank", len(nodes)))] = data
    findings, damaged = read_events(layout.run_findings_path(run_dir))
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
    return Run(run_dir, manifest, nodes, ranks, findings, warnings)

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
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


@dataclass
class Run:
    path: Path
    manifest: dict | None
    nodes: dict[int, dict]
    ranks: dict[int, RankStream]
    findings: list[dict] = field(default_factory=list)
    """Run-level finding records (cross-rank verdicts), from findings.jsonl."""

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
    findings, _ = read_events(layout.run_findings_path(run_dir))
    return Run(run_dir, read_json(layout.manifest_path(run_dir)), nodes, ranks, findings)

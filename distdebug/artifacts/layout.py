"""Every path inside a run directory comes from a template here, so readers and writers agree.

    RUN/manifest.json                 run manifest (written by the node-rank-0 launcher)
    RUN/nodes/node-NNN.json           per launcher agent: host, start/end, exit code, failures
    RUN/rank-NNNNN/events.jsonl       per rank: append-only JSON Lines (start, discovery, step, finding, end)
"""

from __future__ import annotations

from pathlib import Path

MANIFEST = "manifest.json"
NODE_TEMPLATE = "nodes/node-{node:03d}.json"
RANK_DIR_TEMPLATE = "rank-{rank:05d}"
EVENTS = "events.jsonl"
DEFAULT_RUNS_ROOT = "distdebug-runs"
LATEST_LINK = "latest"


def manifest_path(run_dir: Path) -> Path:
    return run_dir / MANIFEST


def node_path(run_dir: Path, node: int) -> Path:
    return run_dir / NODE_TEMPLATE.format(node=node)


def rank_dir(run_dir: Path, rank: int) -> Path:
    return run_dir / RANK_DIR_TEMPLATE.format(rank=rank)


def events_path(run_dir: Path, rank: int) -> Path:
    return rank_dir(run_dir, rank) / EVENTS


def rank_of_dir(name: str) -> int | None:
    """Inverse of RANK_DIR_TEMPLATE: ``rank-00012`` -> 12; anything else -> None."""
    prefix = RANK_DIR_TEMPLATE.split("{")[0]
    if not name.startswith(prefix):
        return None
    digits = name[len(prefix):]
    return int(digits) if digits.isdigit() else None

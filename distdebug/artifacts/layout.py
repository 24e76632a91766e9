"""Every path inside a run directory comes from a template here, so readers and writers agree.

    RUN/manifest.json                 run manifest (written by the node-rank-0 launcher)
    RUN/nodes/node-NNN.json           per launcher agent: host, start/end, exit code, failures
    RUN/rank-NNNNN/events.jsonl       per rank: append-only JSON Lines (start, discovery, step, finding, end)
    RUN/rank-NNNNN/stacks.txt         per rank, on a stall: Python stacks of all threads
    RUN/rank-NNNNN/fr_trace.pkl       per rank, on a stall: PyTorch Flight Recorder dump (pickle, torch's format)
    RUN/rank-NNNNN/inflight           per rank: the collective it is inside now (memory-mapped, survives a crash)
    RUN/rank-NNNNN/crash.txt          per rank, on a fatal signal (SIGABRT, SIGSEGV): Python stacks (faulthandler)
    RUN/rank-NNNNN/fingerprints.bin   per rank: per checked step, a fingerprint per replicated tensor (binary)
    RUN/rank-NNNNN/fingerprint-names.json  the tensor names those fingerprints refer to
    RUN/rank-NNNNN/checkpoints.jsonl  per rank: fingerprints of every checkpoint it saved (path, step, file stamp)
    RUN/findings.jsonl                run-level findings (cross-rank verdicts such as hangs), append-only
"""

from __future__ import annotations

from pathlib import Path

MANIFEST = "manifest.json"
NODE_TEMPLATE = "nodes/node-{node:03d}.json"
RANK_DIR_TEMPLATE = "rank-{rank:05d}"
EVENTS = "events.jsonl"
STACKS = "stacks.txt"
FR_TRACE = "fr_trace.pkl"
RUN_FINDINGS = "findings.jsonl"
INFLIGHT = "inflight"
FINGERPRINTS = "fingerprints.bin"
FINGERPRINT_NAMES = "fingerprint-names.json"
CRASH = "crash.txt"
CHECKPOINTS = "checkpoints.jsonl"
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


def stacks_path(run_dir: Path, rank: int) -> Path:
    return rank_dir(run_dir, rank) / STACKS


def fr_trace_path(run_dir: Path, rank: int) -> Path:
    return rank_dir(run_dir, rank) / FR_TRACE


def inflight_path(run_dir: Path, rank: int) -> Path:
    return rank_dir(run_dir, rank) / INFLIGHT


def crash_path(run_dir: Path, rank: int) -> Path:
    return rank_dir(run_dir, rank) / CRASH


def run_findings_path(run_dir: Path) -> Path:
    return run_dir / RUN_FINDINGS


def rank_of_dir(name: str) -> int | None:
    """Inverse of RANK_DIR_TEMPLATE: ``rank-00012`` -> 12; anything else -> None."""
    prefix = RANK_DIR_TEMPLATE.split("{")[0]
    if not name.startswith(prefix):
        return None
    digits = name[len(prefix):]
    return int(digits) if digits.isdigit() else None

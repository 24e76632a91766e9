"""Every path inside a run directory comes from a template here, so readers and writers agree.

``FILES`` lists them all with what each holds; the docs' run-directory page (docs/reference/run-directory.md) is checked
against it (tests/unit/test_layout_readme.py), so a new file is documented or the suite fails.
"""

from __future__ import annotations

from pathlib import Path

MANIFEST = "manifest.json"
NODE_TEMPLATE = "nodes/node-{node:03d}.json"
RANK_DIR_TEMPLATE = "rank-{rank:05d}"
EVENTS = "events.jsonl"
STACKS = "stacks.txt"
STACKS_REQUEST = "requests/stacks.json"
STACKS_ANSWER = "stacks-now.json"
FR_TRACE = "fr_trace.pkl"
RUN_FINDINGS = "findings.jsonl"
INFLIGHT = "inflight"
INDEX = "index.json"
ESSENTIAL = "essential.jsonl"
FINGERPRINTS = "fingerprints.bin"
FINGERPRINT_NAMES = "fingerprint-names.json"
FINGERPRINT_ROOTS = "fingerprint-roots.bin"
FINGERPRINT_BLOCKS = "fingerprint-blocks.bin"
FINGERPRINT_ROOT_BYTES = 24
"""One record of FINGERPRINT_ROOTS: int64 step | int32 names id | int32 tensors | uint64 digest."""
SEGMENT_TEMPLATE = "{stem}.{n:06d}{suffix}"
"""A rotated segment of an append-only stream (artifacts.retention): ``events.000003.jsonl``."""
THINNED_TEMPLATE = "{stem}.thinned{suffix}"
THINNED_STATS = "events.thinned.json"
CRASH = "crash.txt"
CHECKPOINTS = "checkpoints.jsonl"
DOCTOR = "doctor.json"
TRACES = "traces"
TRACE_WINDOW_TEMPLATE = "steps-{start}-{end}"
TRACE_FILE_TEMPLATE = "rank-{rank:05d}.pt.trace.json.gz"
TRACE_WINDOW_KEY = "distdebug_window"
"""Top-level key of each window's trace: {"planned": [A, B], "steps": the steps that completed inside
the window, [A, last], or [] when the job ended inside step A}: which ``ProfilerStep#N`` marks are steps."""
DEFAULT_RUNS_ROOT = "distdebug-runs"
LATEST_LINK = "latest"

REWRITTEN = frozenset({INDEX, THINNED_STATS, STACKS_ANSWER, INFLIGHT, FINGERPRINT_NAMES})
"""A rank's files that are replaced whole or rewritten in place, each bounded whatever the run's length: never a
rate of growth (the log-volume guard leaves them out of what the run directory writes an hour)."""

FILES: tuple[tuple[str, str], ...] = (
    (MANIFEST, "command, launcher options, versions (python, torch, deepspeed, CUDA, NCCL, cuDNN), host, "
               "environment with secrets redacted; after the job the world size and rank -> node/host/pid"),
    (NODE_TEMPLATE, "per launcher agent: host, start/end, exit code, first failure, the log-volume guard's "
                    "prediction beside what was then written; while the job runs, the environment check's findings "
                    "(env_check, made before the ranks start; filed to findings.jsonl at the end)"),
    (RUN_FINDINGS, "run-level verdicts (hangs, failed collectives, a killed rank, the offline replica check, "
                   "teardown, dangerous environment, a file system that would fill), append-only"),
    (DOCTOR, "distdebug doctor's results (rank 0 writes them): environment, differences, bandwidth, link matrix"),
    (f"{TRACES}/{TRACE_WINDOW_TEMPLATE}/{TRACE_FILE_TEMPLATE}",
     "a profiler window of each rank: torch's gzip Chrome trace (--profile-steps, --profile-on-finding)"),
    (f"{RANK_DIR_TEMPLATE}/{EVENTS}", "per rank, append-only JSON Lines: the record kinds below"),
    (f"{RANK_DIR_TEMPLATE}/{ESSENTIAL}", "per rank, every record of events.jsonl but the per-step ones, each "
                                         "with its position in the stream (\"i\"): what readers at scale read "
                                         "instead of the whole stream (artifacts.writer.Indexer)"),
    (f"{RANK_DIR_TEMPLATE}/{INDEX}", "per rank, rewritten every 256 records: the position in events.jsonl it "
                                     "covers and a digest of the per-step records up to there (last step, first "
                                     "and last loss, step-time histogram, curves, the last 64 step records: "
                                     "artifacts.digest)"),
    (f"{RANK_DIR_TEMPLATE}/.{EVENTS}.reserve", "while the rank runs: disk space held back (zeros) for its findings, "
                                                "a stall and its end record if the disk fills (artifacts.writer)"),
    (f"{RANK_DIR_TEMPLATE}/{INFLIGHT}", "the collective the rank is inside now (memory-mapped; survives a crash)"),
    (f"{RANK_DIR_TEMPLATE}/{STACKS}", "on a stall: every thread's Python stack"),
    (STACKS_REQUEST, "distdebug stacks' latest request (its id and time): each rank's watchdog answers it"),
    (f"{RANK_DIR_TEMPLATE}/{STACKS_ANSWER}", "the rank's answer to distdebug stacks: every thread's stack, "
                                             "step, phase, collective in flight (replaced at each request)"),
    (f"{RANK_DIR_TEMPLATE}/{FR_TRACE}",
     "on a stall or failed collective: PyTorch Flight Recorder dump (torch's pickle)"),
    (f"{RANK_DIR_TEMPLATE}/{CRASH}", "on a fatal signal (SIGABRT, SIGSEGV): faulthandler stacks (empty otherwise)"),
    (f"{RANK_DIR_TEMPLATE}/{FINGERPRINTS}", "per checked step, a fingerprint per replicated tensor (binary, "
                                            "append-only; read by distdebug diff)"),
    (f"{RANK_DIR_TEMPLATE}/{FINGERPRINT_BLOCKS}", "per block of steps, a digest per tensor of its fingerprints over "
                                                  "the block (binary; diff finds the first block that differs, "
                                                  "then reads only the ranks and steps it needs)"),
    (f"{RANK_DIR_TEMPLATE}/{FINGERPRINT_NAMES}", "the tensor names those fingerprints refer to"),
    (f"{RANK_DIR_TEMPLATE}/events.{{n:06d}}.jsonl",
     "rotated segments of events.jsonl once it reaches its part of --run-dir-budget (artifacts.retention): "
     "segment 0 (the first steps) and the newest 3 kept whole"),
    (f"{RANK_DIR_TEMPLATE}/events.thinned.jsonl", "the segments that left the ring: every record but the "
                                                  "per-step ones, the steps around each finding, and one "
                                                  "steps_thinned summary per window of steps"),
    (f"{RANK_DIR_TEMPLATE}/{THINNED_STATS}", "what events.thinned.jsonl's summaries hold (summaries, steps, the "
                                             "smallest and largest window, the first and last step): the report's "
                                             "'thinned' line without reading it"),
    (f"{RANK_DIR_TEMPLATE}/fingerprints.{{n:06d}}.bin", "rotated segments of fingerprints.bin (as events)"),
    (f"{RANK_DIR_TEMPLATE}/fingerprints.thinned.bin", "the steps around each finding, from segments that left "
                                                      "the ring (same format as fingerprints.bin)"),
    (f"{RANK_DIR_TEMPLATE}/{FINGERPRINT_ROOTS}", "the other thinned steps: one digest of all tensors a step "
                                                 "(int64 step | uint64 digest): diff tells agreement, not the "
                                                 "tensor"),
    (f"{RANK_DIR_TEMPLATE}/{CHECKPOINTS}", "fingerprints of every checkpoint the rank saved (path, step, file stamp), "
                                           "append-only"),
)
"""(template relative to the run directory, what it holds), for every file a run directory may hold."""


def reserve_path(path: Path) -> Path:
    """The space an append-only file's writer holds back beside it (``.NAME.reserve``)."""
    return path.with_name(f".{path.name}.reserve")


def segment_path(live: Path, n: int) -> Path:
    """Segment ``n`` of the stream whose live file is ``live`` (``events.jsonl`` -> ``events.000003.jsonl``)."""
    return live.with_name(SEGMENT_TEMPLATE.format(stem=live.stem, n=n, suffix=live.suffix))


def thinned_path(live: Path) -> Path:
    return live.with_name(THINNED_TEMPLATE.format(stem=live.stem, suffix=live.suffix))


def segments(live: Path) -> list[tuple[int, Path]]:
    """(n, path) of the stream's rotated segments, oldest first; none when it never rotated."""
    prefix, suffix = f"{live.stem}.", live.suffix
    try:
        children = list(live.parent.iterdir())
    except OSError:
        return []
    out = []
    for c in children:
        digits = c.name[len(prefix):len(c.name) - len(suffix)] if c.name.endswith(suffix) else ""
        if c.name.startswith(prefix) and len(digits) == 6 and digits.isdigit():
            out.append((int(digits), c))
    return sorted(out)


def stream_files(live: Path) -> list[Path]:
    """Every file of a rotated stream in the order its records were written: the head (segment 0), the
    thinned file (what left the ring), the ring's segments, the live file. Only the live file for a stream
    that never rotated."""
    segs = segments(live)
    head = [p for n, p in segs if n == 0]
    thinned = thinned_path(live)
    return head + ([thinned] if thinned.exists() else []) + [p for n, p in segs if n > 0] + [live]


def manifest_path(run_dir: Path) -> Path:
    return run_dir / MANIFEST


def node_path(run_dir: Path, node: int) -> Path:
    return run_dir / NODE_TEMPLATE.format(node=node)


def rank_dir(run_dir: Path, rank: int) -> Path:
    return run_dir / RANK_DIR_TEMPLATE.format(rank=rank)


def index_path(events: Path) -> Path:
    """The index of the event stream whose live file is ``events``."""
    return events.with_name(INDEX)


def essential_path(events: Path) -> Path:
    """The essential records of the event stream whose live file is ``events``."""
    return events.with_name(ESSENTIAL)


def events_path(run_dir: Path, rank: int) -> Path:
    return rank_dir(run_dir, rank) / EVENTS


def stacks_path(run_dir: Path, rank: int) -> Path:
    return rank_dir(run_dir, rank) / STACKS


def stacks_request_path(run_dir: Path) -> Path:
    return run_dir / STACKS_REQUEST


def stacks_answer_path(run_dir: Path, rank: int) -> Path:
    return rank_dir(run_dir, rank) / STACKS_ANSWER


def fr_trace_path(run_dir: Path, rank: int) -> Path:
    return rank_dir(run_dir, rank) / FR_TRACE


def inflight_path(run_dir: Path, rank: int) -> Path:
    return rank_dir(run_dir, rank) / INFLIGHT


def checkpoints_path(run_dir: Path, rank: int) -> Path:
    return rank_dir(run_dir, rank) / CHECKPOINTS


def crash_path(run_dir: Path, rank: int) -> Path:
    return rank_dir(run_dir, rank) / CRASH


def run_findings_path(run_dir: Path) -> Path:
    return run_dir / RUN_FINDINGS


def doctor_path(run_dir: Path) -> Path:
    return run_dir / DOCTOR


def traces_root(run_dir: Path) -> Path:
    return run_dir / TRACES


def trace_dir(run_dir: Path, start: int, end: int) -> Path:
    return traces_root(run_dir) / TRACE_WINDOW_TEMPLATE.format(start=start, end=end)


def trace_path(run_dir: Path, start: int, end: int, rank: int) -> Path:
    return trace_dir(run_dir, start, end) / TRACE_FILE_TEMPLATE.format(rank=rank)


def rank_of_dir(name: str) -> int | None:
    """Inverse of RANK_DIR_TEMPLATE: ``rank-00012`` -> 12; anything else -> None."""
    prefix = RANK_DIR_TEMPLATE.split("{")[0]
    if not name.startswith(prefix):
        return None
    digits = name[len(prefix):]
    return int(digits) if digits.isdigit() else None


def rank_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(rank, its folder) for every rank folder of the run directory, by rank; none when it does not exist.
    The one enumeration of ranks: every reader, the launcher and the detectors go through it."""
    try:
        children = list(run_dir.iterdir())
    except OSError:  # not there (yet), or unreadable: no ranks to read
        return []
    found = [(rank, c) for c in children if (rank := rank_of_dir(c.name)) is not None and c.is_dir()]
    return sorted(found)


def node_of_file(name: str) -> int | None:
    """Inverse of NODE_TEMPLATE's file name: ``node-003.json`` -> 3; anything else -> None."""
    prefix, _, suffix = NODE_TEMPLATE.rpartition("/")[2].partition("{")
    end = suffix.partition("}")[2]
    if not (name.startswith(prefix) and name.endswith(end)):
        return None
    digits = name[len(prefix):len(name) - len(end)]
    return int(digits) if digits.isdigit() else None


def node_files(run_dir: Path) -> list[tuple[int, Path]]:
    """(node, its file) for every node file the launchers wrote, by node; none when there are none."""
    folder = node_path(run_dir, 0).parent
    try:
        children = list(folder.iterdir())
    except OSError:
        return []
    return sorted((node, c) for c in children if (node := node_of_file(c.name)) is not None and c.is_file())


def trace_window_of_dir(name: str) -> tuple[int, int] | None:
    """Inverse of TRACE_WINDOW_TEMPLATE: ``steps-3-4`` -> (3, 4); anything else -> None."""
    head, _, tail = name.partition("-")
    start, _, end = tail.partition("-")
    if head != TRACE_WINDOW_TEMPLATE.partition("-")[0] or not (start.isdigit() and end.isdigit()):
        return None
    return int(start), int(end)


def trace_windows(run_dir: Path) -> list[tuple[tuple[int, int] | None, Path]]:
    """(steps of the window or None, its folder) for every folder of the run's profiler traces, by steps."""
    root = traces_root(run_dir)
    try:
        folders = [d for d in root.iterdir() if d.is_dir()]
    except OSError:
        return []
    return sorted(((trace_window_of_dir(d.name), d) for d in folders), key=lambda w: (w[0] or (0, 0), w[1].name))


def trace_files(window: Path) -> list[tuple[int, Path]]:
    """(rank, its trace) in a window's folder: TRACE_FILE_TEMPLATE's files, compressed or not (a GPU
    profiler's own export), by rank."""
    prefix = TRACE_FILE_TEMPLATE.split("{")[0]
    out = []
    for f in sorted(window.glob(f"{prefix}*.json*")):
        digits = f.name[len(prefix):].partition(".")[0]
        if digits.isdigit():
            out.append((int(digits), f))
    return sorted(out)


"""After the job: one analysis pass that loads the run once and writes every run-level verdict.

The launcher only launches and supervises; what went wrong is decided here, from what the ranks
wrote and what torch's launcher saw (which rank failed first, with which exit status):

1. teardown: every failed rank had finished the script and died in interpreter exit (results
   are complete; ``analysis.teardown``);
2. post-mortem: a failed collective, a rank that left, a rank killed from outside
   (``analysis.hang.diagnose``), unless the supervisor already named a hang during the job;
3. replicas: the steps the online check did not exchange (the last ones of a run that crashed,
   hung or never destroyed its process group) compared from the snapshots, with the online
   detector's rule and wording (``fingerprint.compare.divergence_finding``);
4. the realised layout (world size, rank -> node/host/pid), only known after rendezvous.

Every step is guarded: an analysis that fails says so in one line and never changes the job's
exit code.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distdebug.artifacts import layout, schema
from distdebug.artifacts.reader import Run, load_run
from distdebug.artifacts.writer import append_run_findings
from distdebug.findings import Finding

OFFLINE_CHECK_MAX_BYTES = 256 << 20
"""Snapshots larger than this in all are left to ``distdebug diff`` (a note says so)."""


@dataclass
class JobEnd:
    """What torch's launcher saw: the exit code and each failed rank's exit status."""

    exit_code: int
    failures: dict[int, int] = field(default_factory=dict)
    """rank -> exit status (negative: the signal that ended it)."""
    first_failure: int | None = None
    """The rank torch's launcher reports as the first to fail (the root cause)."""
    hang_named: bool = False
    """The supervisor already wrote a hang verdict during the job."""
    primary: bool = True
    """This launcher is node rank 0 (the one that writes run-level verdicts)."""


@dataclass
class AfterJob:
    findings: list[Finding] = field(default_factory=list)
    """The run-level verdicts written by this pass, in the order they were made."""
    completed: bool = False
    """Every failed rank had finished the script: a teardown abort, not a training failure."""
    notes: list[str] = field(default_factory=list)
    """One-line notes for the terminal (an analysis that could not run, a check left to diff)."""
    world_size: int | None = None
    layout: dict[str, Any] = field(default_factory=dict)
    """rank -> {node, local_rank, host, pid, attempt}, from the ranks' start records."""
    never_acted: list[str] = field(default_factory=list)
    """Faults injected on purpose that no rank recorded acting, or whose act was undone (judged only when every
    rank's stream is in the run directory: a node that sees its own ranks only cannot tell)."""
    why_not: dict[str, list[str]] = field(default_factory=dict)
    """Fault -> its own reasons for not acting (summary.why_not)."""


def analyse(run_dir: Path, end: JobEnd) -> AfterJob:
    """The pass: load the run once, make every run-level verdict, append them to findings.jsonl."""
    out = AfterJob()
    try:
        run = load_run(run_dir)
    except Exception as e:  # a damaged run directory must not hide the job's own outcome
        out.notes.append(f"could not read the run directory: {type(e).__name__}: {e}")
        return out
    if end.failures:
        _guarded(out, "read the ranks' end records", lambda: _teardown(run, end, out))
    if end.exit_code != 0 and end.primary and not out.completed and not end.hang_named:
        _guarded(out, "diagnose the failure", lambda: _post_mortem(run, end, out))
    if end.primary:
        _guarded(out, "run the offline replica check", lambda: _replicas(run, run_dir, out))
    _guarded(out, "read the layout", lambda: _layout(run, out))
    if run.manifest and run.manifest.get("faults"):
        _guarded(out, "read which faults acted", lambda: _never_acted(run, out))
    if out.findings:  # printed by attach whatever happens here: a full disk loses the file, not the verdicts
        _guarded(out, f"write the run's findings to {layout.RUN_FINDINGS}",
                 lambda: append_run_findings(run_dir, out.findings))
    return out


def _guarded(out: AfterJob, what: str, fn: Any) -> None:
    try:
        fn()
    except Exception as e:  # one failed analysis must not stop the others, nor change the exit code
        out.notes.append(f"could not {what}: {type(e).__name__}: {e}")


def _teardown(run: Run, end: JobEnd, out: AfterJob) -> None:
    from distdebug.analysis.teardown import teardown_findings

    found = teardown_findings(run, end.failures, first=end.first_failure)
    if found:
        out.findings += found
        out.completed = True


def _post_mortem(run: Run, end: JobEnd, out: AfterJob) -> None:
    from distdebug.analysis.hang import diagnose

    first = None
    if end.first_failure is not None and end.first_failure in end.failures:
        first = (end.first_failure, end.failures[end.first_failure])
    out.findings += diagnose(run, first)


def _replicas(run: Run, run_dir: Path, out: AfterJob) -> None:
    from distdebug.analysis.diff import first_divergent_step, load_snapshots, scaled
    from distdebug.fingerprint.compare import divergence_finding

    if any(f.get("detector") == "replica_divergence" for f in run.all_findings()):
        return  # the online check already named the first divergent step
    size = sum(p.stat().st_size for _, d in layout.rank_dirs(run_dir)
               for p in layout.stream_files(d / layout.FINGERPRINTS) if p.is_file())
    if not size:
        return
    if size > OFFLINE_CHECK_MAX_BYTES:
        big = scaled([run_dir])  # through the fingerprint blocks: a few KB a rank, one rank per class read
        if big is None:
            out.notes.append(f"fingerprint snapshots are {size >> 20} MiB; run 'distdebug diff {run_dir}' to check "
                             "the last steps offline")
            return
        first = big.first()
        if first is None:
            return
        step, diffs, snaps, roots = first
    else:
        roots = {}
        snaps = load_snapshots(run_dir, roots)
        found = first_divergent_step(snaps, roots)
        if found is None:
            return
        step, diffs = found
    compared = sum(1 for r in set(snaps) | set(roots) if step in snaps.get(r, {}) or step in roots.get(r, {}))
    ddp = any("ddp" in (m.get("wrappers") or [])
              for s in run.ranks.values() for d in s.of_kind(schema.DISCOVERY) for m in d.get("models") or [])
    names = next((list(s[step][0]) for s in snaps.values() if step in s),
                 next((list(r[step][0]) for r in roots.values() if step in r), []))
    out.findings.append(divergence_finding(step, [d.to_dict() for d in diffs], compared, after_job=True,
                                           run_dir=str(run_dir), ddp=ddp, compared=names))


def _never_acted(run: Run, out: AfterJob) -> None:
    from distdebug.analysis.summary import never_acted, why_not

    if out.world_size is None or len(run.ranks) < out.world_size:
        return  # another node's ranks write elsewhere: whether they acted is not known here
    records = [r for s in run.ranks.values() for r in s.last_attempt()]
    injected = [r for r in records if r.get("kind") == schema.INJECTED]
    not_acted = [r for r in records if r.get("kind") == schema.NOT_ACTED]
    out.never_acted = never_acted((run.manifest or {}).get("faults"), injected, not_acted)
    out.why_not = why_not(out.never_acted, not_acted)


def _layout(run: Run, out: AfterJob) -> None:
    for rank, stream in sorted(run.ranks.items()):
        start = next((r for r in reversed(stream.records) if r.get("kind") == schema.START), None)
        if start is None:
            continue
        out.world_size = start.get("world_size", out.world_size)
        out.layout[str(rank)] = {k: start.get(k) for k in ("node", "local_rank", "host", "pid", "ppid", "attempt")}


def print_notes(result: AfterJob) -> None:
    for note in result.notes:
        print(f"distdebug: {note}", file=sys.stderr, flush=True)

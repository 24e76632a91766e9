"""A rank that finished the script and then died in interpreter exit: told apart from a crash.

torch's launcher sees only an exit status: a rank that printed its last line and then aborted
while the interpreter tore down gloo's or NCCL's threads ("terminate called without an active
exception", SIGABRT) fails the job exactly like a rank that crashed mid-training. The rank's own
``end`` record says it got past the script (the bootstrap writes it after the script returned,
before interpreter exit), and what was still alive then. The exit code stays torchrun's; the
words change: results are complete, and here is what to release before exiting.
"""

from __future__ import annotations

import signal
from collections import Counter
from typing import Any

from distdebug.artifacts import schema
from distdebug.artifacts.reader import Run
from distdebug.findings import Finding, Severity

DETECTOR = "teardown"


def how(code: int) -> str:
    """'SIGABRT' for a negative (signal) exit status, 'exit code N' otherwise."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _records_without_error(run: Run, rank: int) -> list[dict[str, Any]] | None:
    """The rank's records of its last attempt, or None if it has none or raised (a script error)."""
    stream = run.ranks.get(rank)
    if stream is None:
        return None
    records = stream.last_attempt()
    if any(r.get("kind") == schema.SCRIPT_ERROR for r in records):
        return None
    return records


def completed_end(run: Run, rank: int) -> dict[str, Any] | None:
    """The rank's end record if its script finished cleanly (exit 0, no script error); else None."""
    records = _records_without_error(run, rank)
    if records is None:
        return None
    end = next((r for r in reversed(records) if r.get("kind") == schema.END), None)
    if end is None or end.get("exit_code") not in (0, None):
        return None
    return end


def _alive_text(alive: dict[str, Any]) -> str:
    parts = []
    if alive.get("process_groups"):
        parts.append(f"{alive['process_groups']} process group(s) not destroyed")
    threads = Counter(alive.get("native_threads") or [])
    ours = {"distdebug-watchdog"}
    shown = [f"{n} x{c}" if c > 1 else n for n, c in sorted(threads.items()) if n not in ours]
    if shown:
        parts.append("threads " + ", ".join(shown))
    py = [t for t in alive.get("python_threads") or [] if not t.startswith("distdebug")]
    if py:
        parts.append("Python threads " + ", ".join(py))
    return "; ".join(parts)


def teardown_findings(run: Run, failures: dict[int, int], first: int | None = None) -> list[Finding] | None:
    """A finding per rank that died at interpreter exit when *every* failure came after the script
    completed, else None.

    failures: global rank -> exit status as torch's launcher saw it (negative: killed by signal);
    first: the rank that failed first (the launcher then stops the others with SIGTERM: those are
    its doing, not theirs, and get no finding of their own).
    """
    if not failures:
        return None
    first = first if first in failures else min(failures)
    ends = {rank: completed_end(run, rank) for rank in failures}
    first_end = ends[first]
    if first_end is None:
        return None  # the root cause failed inside the script: a real failure
    # A rank the launcher stopped (SIGTERM) after the first failure, before it wrote its end record,
    # is the launcher's doing: acceptable when it had run every step the finished rank ran and
    # raised nothing (it was at its own end of the script, or in what follows the last step).
    steps = first_end.get("steps") or 0
    stopped = sorted(r for r, end in ends.items() if end is None and r != first
                     and failures[r] == -signal.SIGTERM and _clean_through(run, r, steps))
    if any(end is None for r, end in ends.items() if r not in stopped):
        return None  # at least one rank failed inside the script: a real failure
    order = [first] + sorted(r for r in failures if r != first and failures[r] != -signal.SIGTERM)
    out = []
    for rank, code in ((r, failures[r]) for r in order):
        end = ends[rank] or {}
        alive = end.get("alive") or {}
        still = _alive_text(alive)
        kind = "aborted" if code < 0 else "exited"
        out.append(Finding(
            severity=Severity.WARNING, detector=DETECTOR, ranks=[rank], step=end.get("steps") or None,
            subject="interpreter exit",
            message=f"rank {rank} completed the script and {kind} during interpreter exit ({how(code)}): "
                    "results are complete; "
                    + ("a known teardown race in torch's gloo/NCCL shutdown" if code < 0 else
                       "an atexit handler or a finaliser ended it")
                    + (f". Still alive when the script ended: {still}" if still else "")
                    + (f". Rank(s) {stopped} were stopped by the launcher (SIGTERM) after their last step "
                       f"({steps}) and before they recorded their end: anything they did after that step (a final "
                       "save) may be incomplete" if stopped and rank == first else ""),
            evidence={"exit_status": code, "alive": alive, "steps": end.get("steps")},
            fix="call torch.distributed.destroy_process_group() after the last collective (every group you "
                "created, then the default one), stop your own threads and DataLoader workers, and let the "
                "script return; if it still aborts, end with sys.stdout.flush(); os._exit(0) after destroying "
                "the groups",
        ))
    return out


def _clean_through(run: Run, rank: int, steps: int) -> bool:
    """The rank recorded ``steps`` optimizer steps (at least) and no script error."""
    records = _records_without_error(run, rank)
    if records is None:
        return False
    return max((int(r.get("step", 0)) for r in records if r.get("kind") == schema.STEP), default=0) >= steps


def summary_line(findings: list[Finding]) -> str:
    """The launcher's one line for a job whose only failures were at interpreter exit."""
    first = findings[0].message.split(": results are complete")[0]
    more = f" (and {len(findings) - 1} more rank(s) the same way)" if len(findings) > 1 else ""
    return f"{first}{more}: results are complete; a teardown problem, not a training failure"

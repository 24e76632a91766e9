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


def completed_end(run: Run, rank: int) -> dict[str, Any] | None:
    """The rank's end record if its script finished cleanly (exit 0, no script error); else None."""
    stream = run.ranks.get(rank)
    if stream is None:
        return None
    records = stream.last_attempt()
    if any(r.get("kind") == schema.SCRIPT_ERROR for r in records):
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
    ends = {rank: completed_end(run, rank) for rank in failures}
    if any(end is None for end in ends.values()):
        return None  # at least one rank failed inside the script: a real failure
    first = first if first in failures else min(failures)
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
                    + (f". Still alive when the script ended: {still}" if still else ""),
            evidence={"exit_status": code, "alive": alive, "steps": end.get("steps")},
            fix="call torch.distributed.destroy_process_group() after the last collective (every group you "
                "created, then the default one), stop your own threads and DataLoader workers, and let the "
                "script return; if it still aborts, end with sys.stdout.flush(); os._exit(0) after destroying "
                "the groups",
        ))
    return out


def summary_line(findings: list[Finding]) -> str:
    """The launcher's one line for a job whose only failures were at interpreter exit."""
    first = findings[0].message.split(": results are complete")[0]
    more = f" (and {len(findings) - 1} more rank(s) the same way)" if len(findings) > 1 else ""
    return f"{first}{more}: results are complete; a teardown problem, not a training failure"

"""The log-volume guard's verdict: a file system that fills before the job's expected end, with the numbers
and the fix for what fills it. The launcher's guard (launch.volume) measures; the verdict is made here, as
every verdict is, from plain facts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from distdebug.doctor.volume import EnvLog, hours_text, size
from distdebug.findings import Finding, Severity

DETECTOR = "log_volume"


@dataclass(frozen=True)
class Part:
    """One destination on the file system: what it wrote an hour, and where it stops (its budget)."""

    key: str
    """``run`` (the run directory), ``stdout``, ``stderr``, ``log_dir`` (torchrun's), ``nccl_file``."""
    label: str
    bytes_per_hour: float
    cap: float | None = None


def fill_finding(*, mount: str, free: int, hours: float, hours_left: float, parts: list[Part], logs: list[EnvLog],
                 budget: int, over: str, expected_source: str, ranks: list[int], step: int | None) -> Finding:
    """The warning for a file system that fills in ``hours`` while the job has ``hours_left`` to run. The fix is
    for the part that will have written the most by then (a bounded part stops at its budget)."""
    parts = sorted(parts, key=lambda p: -min(p.bytes_per_hour * hours, p.cap if p.cap is not None else math.inf))
    said = ", ".join(f"{p.label} {size(p.bytes_per_hour)} an hour"
                     + (f" (at most {size(p.cap)} more: its budget)" if p.cap is not None else "")
                     for p in parts if p.bytes_per_hour > 0)
    top = parts[0].key
    nccl = [log for log in logs if log.per_collective]
    if top == "run":
        fix = f"lower --run-dir-budget (now {size(budget)} a rank), or give --run-dir on a file system with room"
    elif top == "nccl_file" or (nccl and top in ("stdout", "stderr", "log_dir")):
        fix = nccl[0].fix if nccl else "point NCCL_DEBUG_FILE at a file system with room"
        said += f" (the environment sets {nccl[0].setting}: a line per collective per rank)" if nccl else ""
    else:
        fix = ("the script's own output: print less often (every N steps, rank 0 only), or send the job's output "
               "to a file system with room")
    return Finding(
        severity=Severity.WARNING, detector=DETECTOR, ranks=ranks, step=step, subject=mount,
        message=(f"the file system of {mount} ({size(free)} free) fills in {hours_text(hours)} at the rate this node "
                 f"wrote {over}: {said}; the job is expected to run "
                 f"{hours_text(hours_left)} more ({expected_source})"),
        fix=fix,
        evidence={"free_bytes": free, "hours_to_fill": round(hours, 4), "hours_left": round(hours_left, 4),
                  "bytes_per_hour": {p.key: round(p.bytes_per_hour) for p in parts}},
    )


def unmeasured_finding(*, log: EnvLog, bytes_per_hour: float, collectives_per_s: float, hours_left: float,
                       expected_source: str, ranks: list[int], step: int | None) -> Finding:
    """Per-collective lines to a console that is not a file (a pipe to srun, a terminal): where they end up, and
    that file system's room, cannot be seen from here; said with the volume, a warning past 1 GiB by the end."""
    total = bytes_per_hour * hours_left
    return Finding(
        severity=Severity.WARNING if total > 1 << 30 else Severity.INFO, detector=DETECTOR, ranks=ranks, step=step,
        subject=log.setting,
        message=(f"{log.setting} writes a line per collective per rank to {log.target}, which is not a file here "
                 f"(a pipe or a terminal: where it lands and the room there cannot be measured): at the "
                 f"{collectives_per_s:.3g} collectives a second counted (collectives launched from C++, such as "
                 f"DDP's bucket all-reduces, not counted), at least {size(bytes_per_hour)} an hour, "
                 f"{size(total)} over the {hours_text(hours_left)} the job is expected to run ({expected_source})"),
        fix=log.fix,
        evidence={"bytes_per_hour": round(bytes_per_hour), "collectives_per_s": round(collectives_per_s, 3),
                  "hours_left": round(hours_left, 4)},
    )

"""What a job will write an hour, where, against the free space there: the log-volume guard's model.

Why: the disk that fills in the middle of a month-long job is rarely filled by the checkpoints someone
sized; it is filled by logs nobody sized. ``NCCL_DEBUG=INFO`` with ``NCCL_DEBUG_SUBSYS=ALL`` (or
``COLL``) writes one line per collective call per rank (NCCL's ``enqueue.cc``: ``INFO(NCCL_COLL, "%s:
opCount %lx sendbuff %p recvbuff %p count %zi datatype %d op %d root %d comm %p [nranks=%d] stream
%p")`` after a ``host:pid:tid [dev] NCCL INFO`` prefix): 10-12 GB in half an hour is reported, and the
disk fills with no clear error. A script's own prints into a Slurm output file grow the same way. The
run directory itself is bounded (``--run-dir-budget``), but a node's ranks times its budget can still
exceed what its file system has free.

Two parts, both pure functions of what they are given (tests hand them any host):
- before the job (``distdebug doctor``, and the start of attach): what the environment turns on, per
  collective and once, and the run directory's bound against its file system's free space;
- during the job (``launch.volume``, the launcher's guard): the bytes each destination actually grew
  over a window after the first steps, the per-collective lines predicted from the collectives counted
  where the log cannot be measured (a pipe, a terminal), and the hours until each file system is full
  (``fill_hours``), against the job's expected length.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

NCCL_COLL_LINE = 200
"""Bytes of one NCCL INFO line for a collective call, prefix and newline included (the format above with a
host name of ~12 characters, 64-bit pointers and a count of 6-8 digits: 170-210 bytes)."""
NCCL_ONCE = 24 << 10
"""Bytes NCCL_DEBUG=INFO writes once per rank and communicator (init, bootstrap, channels, rings, trees:
a few hundred lines on a multi-GPU node); not a rate."""
TORCH_ONCE = 10 << 10
"""Bytes TORCH_DISTRIBUTED_DEBUG=DETAIL with TORCH_CPP_LOG_LEVEL=INFO wrote once per rank on this machine
(c10d's process-group and reducer lines: 19 KB for 2 ranks, the same for 200 or 2,000 steps); not a rate."""
NCCL_SUBSYSTEMS = ("INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC", "CALL", "PROXY",
                   "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS")
NCCL_DEFAULT_SUBSYS = ("INIT", "BOOTSTRAP", "ENV")
"""NCCL's default NCCL_DEBUG_SUBSYS: start-up lines only."""


@dataclass(frozen=True)
class EnvLog:
    """What one environment setting makes every rank write."""

    setting: str
    """As the user set it: ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=ALL``."""
    per_collective: int
    """Bytes per collective call per rank (0: only at start)."""
    once: int
    """Bytes per rank at start."""
    target: str
    """Where it goes: ``stdout``, or a file pattern (NCCL_DEBUG_FILE, ``%h`` host, ``%p`` pid)."""
    fix: str


def nccl_subsystems(value: str | None) -> set[str]:
    """The subsystems NCCL_DEBUG_SUBSYS turns on: a comma list, ``ALL``, or ``^A,B`` (all but)."""
    if value is None or not value.strip():
        return set(NCCL_DEFAULT_SUBSYS)
    v = value.strip().upper()
    exclude = v.startswith("^")
    names = {n.strip() for n in (v[1:] if exclude else v).split(",") if n.strip()}
    if "ALL" in names:
        names = set(NCCL_SUBSYSTEMS)
    return set(NCCL_SUBSYSTEMS) - names if exclude else names


def env_logs(env: dict[str, str]) -> list[EnvLog]:
    """The logging the environment turns on in every rank, with its volume (see the module's docstring)."""
    out: list[EnvLog] = []
    level = env.get("NCCL_DEBUG", "").strip().upper()
    if level in ("INFO", "TRACE"):
        subsys = env.get("NCCL_DEBUG_SUBSYS")
        per = NCCL_COLL_LINE if "COLL" in nccl_subsystems(subsys) else 0
        setting = f"NCCL_DEBUG={env['NCCL_DEBUG']}" + (f" NCCL_DEBUG_SUBSYS={subsys}" if subsys else "")
        target = env.get("NCCL_DEBUG_FILE") or "stdout"
        fix = ("set NCCL_DEBUG_SUBSYS=INIT,ENV (start-up lines only) or NCCL_DEBUG=WARN"
               + ("" if target != "stdout" else ", or NCCL_DEBUG_FILE=/a/large/disk/nccl.%h.%p")
               if per else "set NCCL_DEBUG=WARN once the start-up is understood")
        out.append(EnvLog(setting, per, NCCL_ONCE, target, fix))
    detail = env.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL"
    info = env.get("TORCH_CPP_LOG_LEVEL", "").strip().upper() == "INFO"
    if detail or info:
        setting = " ".join(s for s, on in (("TORCH_DISTRIBUTED_DEBUG=DETAIL", detail),
                                            ("TORCH_CPP_LOG_LEVEL=INFO", info)) if on)
        out.append(EnvLog(setting, 0, TORCH_ONCE if detail and info else TORCH_ONCE // 5, "stderr",
                          "unset them once the start-up is understood (DETAIL also checks every collective)"))
    return out


def nccl_file(pattern: str, host: str) -> str:
    """NCCL_DEBUG_FILE with its host substituted and its pid as a glob (``%h``, ``%p``): NCCL's %h is the short
    host name (up to the first dot)."""
    return pattern.replace("%h", host).replace("%p", "[0-9]*")


def fill_hours(free: float, parts: list[tuple[float, float | None]]) -> float:
    """Hours until ``free`` bytes are written by parts of (bytes an hour, bytes at most or None): inf when
    never. A bounded part (the run directory under its budget) stops growing at its bound."""
    free = max(0.0, free)
    t = 0.0
    written = 0.0
    growing = [(rate, cap) for rate, cap in parts if rate > 0 and (cap is None or cap > 0)]
    while growing:
        rate = sum(r for r, _ in growing)
        ends = [cap / r for r, cap in growing if cap is not None]
        step = min([e - t for e in ends if e > t], default=math.inf)
        if written + rate * step >= free:
            return t + (free - written) / rate
        written += rate * step
        t += step
        growing = [(r, c) for r, c in growing if c is None or c / r > t]
    return math.inf


def hours_text(h: float) -> str:
    if math.isinf(h):
        return "never"
    if h < 1:
        m = max(1, round(h * 60))
        return f"{m} minute{'s' if m != 1 else ''}"
    if h < 48:
        return f"{h:.1f} hours"
    return f"{h / 24:.1f} days"


def size(n: float) -> str:
    """Binary units, as --run-dir-budget takes them."""
    for unit, s in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= s:
            return f"{n / s:.3g} {unit}"
    return f"{n:.0f} B"


def free_bytes(path: str) -> tuple[int, int] | None:
    """(bytes free to this user, the file system's device) of the nearest existing folder, or None."""
    p = os.path.abspath(path)
    while True:
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize, os.stat(p).st_dev
        except OSError:
            parent = os.path.dirname(p)
            if parent == p:
                return None
            p = parent


def mount_point(path: str) -> str:
    """The folder where ``path``'s file system is mounted (the name a user knows it by)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)  # a run directory not made yet: its nearest folder's file system
    try:
        dev = os.stat(p).st_dev
    except OSError:
        return p
    while True:
        parent = os.path.dirname(p)
        try:
            if parent == p or os.stat(parent).st_dev != dev:
                return p
        except OSError:
            return p
        p = parent


def static_lines(env: dict[str, str], *, run_dir: str, budget: int, ranks: int,
                 collectives_per_s: float = 100.0) -> tuple[bool, list[str], list[str]]:
    """(whether to warn, what each part writes, the fixes): before the job, what can be known. The rate of
    collectives is not known before the job: per-collective logging is shown at ``collectives_per_s``."""
    warn = False
    lines: list[str] = []
    fixes: list[str] = []
    where = free_bytes(run_dir)
    if where is not None:
        free, _ = where
        bound = budget * ranks
        head = f"run directory (file system of {mount_point(run_dir)}: {size(free)} free)"
        if budget <= 0:
            lines.append(f"{head}: no --run-dir-budget: grows with the job's length")
        elif bound > free:
            warn = True
            lines.append(f"{head}: {ranks} rank{'s' if ranks != 1 else ''} x {size(budget)} budget = {size(bound)}, "
                         "more than is free")
            fixes.append("lower --run-dir-budget, or give --run-dir on a file system with room")
        else:
            lines.append(f"{head}: at most {size(bound)} ({ranks} x {size(budget)} budget)")
    for log in env_logs(env):
        if log.per_collective:
            warn = True
            hour = log.per_collective * collectives_per_s * 3600 * ranks
            lines.append(f"{log.setting}: a line per collective per rank to {log.target} ({log.per_collective} B): "
                         f"{size(hour)} an hour at {collectives_per_s:g} collectives a second on {ranks} ranks")
        else:
            lines.append(f"{log.setting}: about {size(log.once)} per rank at start, to {log.target}")
        if log.per_collective:
            fixes.append(log.fix)
    return warn, lines, fixes


def summary_text(volume: dict | None) -> str | None:
    """One line of what a node's guard predicted beside what was then written (the node file's ``volume``)."""
    if not volume:
        return None
    if not volume.get("measured"):
        why = str(volume.get("why"))
        return None if why.startswith("the job ended") else f"the log-volume guard failed ({why})"
    parts = []
    for d in volume.get("destinations", []):
        pred, wrote = d.get("predicted_bytes_per_hour") or 0, d.get("written_bytes_per_hour")
        if not pred and not wrote:
            continue
        parts.append(f"{d.get('label')}: predicted {size(pred)} an hour"
                     + ("" if wrote is None else f", then wrote {size(wrote)} an hour"))
    for setting, rate in (volume.get("predicted_lines") or {}).items():
        parts.append(f"{setting} to the console (not a file: not measured): predicted {size(rate)} an hour")
    fills = []
    for mp, fs in (volume.get("file_systems") or {}).items():
        h = fs.get("hours_to_fill")
        when = "does not fill" if h is None else f"fills in {hours_text(h)}"
        fills.append(f"the file system of {mp} ({size(fs.get('free_bytes') or 0)} free) {when}")
    return (f"measured over {volume.get('window_s'):g} s after the first steps, compared over the "
            f"{volume.get('seconds_after'):g} s after: " + ("; ".join(parts) or "nothing written")
            + (f"; at the predicted rate {', '.join(fills)}" if fills else "")
            + f"; the job's expected length: {hours_text(volume.get('expected_hours') or 0)} "
              f"({volume.get('expected_source')})")

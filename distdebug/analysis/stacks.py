"""``distdebug stacks``: every rank's Python stack of a running job, now, grouped by identical stacks.

Why through the run directory: each rank's watchdog thread (runtime.watchdog) already wakes twice a
second and runs while the training thread is blocked in C code (a collective's wait, a sleep, a data
loader); a request file in the run directory is one ``stat`` a wake-up for it, and its answer a file
beside the rank's events. Nothing is sent to the training thread, nothing stops or slows it beyond the
moment its frames are read; no signal handler (Python runs those only on the main thread, which is the
one that is stuck). The same works wherever the run directory is shared; a node that does not share it
answers in its own, read there.

Native frames (the C++/NCCL wait a rank sits in) come from py-spy when it is installed (an optional
extra: ``pip install 'distdebug[native]'``): ``py-spy dump --native --pid PID`` on each rank's process
on this host.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distdebug import strictjson
from distdebug.analysis.hang import user_frame
from distdebug.artifacts import layout, schema
from distdebug.artifacts.reader import read_stream
from distdebug.artifacts.writer import write_json_atomic
from distdebug.errors import UserError
from distdebug.findings import ranks_text

NATIVE_TIMEOUT_S = 10.0
"""Seconds py-spy may take on one process before its dump is given up."""
NATIVE_WIDTH = 160
"""Characters of a native frame's line shown (pybind11's template names run to thousands)."""


@dataclass
class RankAnswer:
    rank: int
    answer: dict[str, Any]

    @property
    def main(self) -> list[dict[str, Any]]:
        return next((t["frames"] for t in self.answer.get("threads", []) if t.get("main")), [])


@dataclass
class Group:
    """Ranks whose main threads stand in the same frames (file, line, function from the outermost in)."""

    ranks: list[int]
    frames: list[dict[str, Any]]
    summary: str
    answers: list[RankAnswer] = field(default_factory=list)


def running_ranks(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Rank -> its last start record, for ranks whose last start has no end record after it (running, or
    killed before they could write one)."""
    out: dict[int, dict[str, Any]] = {}
    for rank, _ in layout.rank_dirs(run_dir):
        records, _ = read_stream(layout.events_path(run_dir, rank))
        start = None
        for r in records:
            if r.get("kind") == schema.START:
                start = r
            elif r.get("kind") == schema.END:
                start = None
        if start is not None:
            out[rank] = start
    return out


def _alive(start: dict[str, Any]) -> bool | None:
    """Whether the rank's process still exists (None: it is on another host, not known from here)."""
    if start.get("host") != socket.gethostname() or not isinstance(start.get("pid"), int):
        return None
    try:
        os.kill(start["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def request(run_dir: Path, timeout: float, poll: float = 0.1) -> tuple[dict[int, RankAnswer], dict[int, str]]:
    """Ask every running rank for its stacks; wait up to ``timeout`` seconds. Returns the answers and, for
    each rank that did not answer, why (as far as can be told from here)."""
    ranks = running_ranks(run_dir)
    if not ranks:
        raise UserError(f"no rank of {run_dir} is running (each wrote its end record, or none started): "
                        "'distdebug stacks' reads a running job; 'distdebug report' reads a finished one")
    asked = uuid.uuid4().hex
    write_json_atomic(layout.stacks_request_path(run_dir),
                      {"id": asked, "time": time.time(), "host": socket.gethostname(), "pid": os.getpid()})
    answers: dict[int, RankAnswer] = {}
    deadline = time.monotonic() + timeout
    while True:
        for rank in ranks:
            if rank in answers:
                continue
            try:
                answer = strictjson.loads(layout.stacks_answer_path(run_dir, rank).read_text())
            except (OSError, ValueError):
                continue
            if answer.get("request") == asked:
                answers[rank] = RankAnswer(rank, answer)
        if len(answers) == len(ranks) or time.monotonic() >= deadline:
            break
        time.sleep(poll)
    missing = {}
    for rank, start in ranks.items():
        if rank in answers:
            continue
        alive = _alive(start)
        where = f"pid {start.get('pid')} on {start.get('host')}"
        missing[rank] = (f"{where} has exited without an end record (killed?)" if alive is False else
                         f"{where} did not answer in {timeout:g} s (its process is stopped, or its node does "
                         "not share this run directory)")
    return answers, missing


OURS = f"{os.sep}distdebug{os.sep}"


def script_frames(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The frames a user reads: without distdebug's own (its launcher's bootstrap and runpy before the
    script, its wrappers between the script and torch)."""
    mine = [f for f in frames if OURS not in str(f.get("file"))]
    first = next((i for i, f in enumerate(mine) if not str(f.get("file")).startswith("<frozen runpy")), 0)
    return mine[first:]


def _key(frames: list[dict[str, Any]]) -> tuple[tuple[Any, Any, Any], ...]:
    """A stack's identity: the frames a user reads (script_frames)."""
    return tuple((f.get("file"), f.get("line"), f.get("func")) for f in script_frames(frames))


def _torch_call(frames: list[dict[str, Any]], after: dict[str, Any] | None) -> str | None:
    """The torch function the script's frame is inside: the public one (torch.distributed.all_reduce, not
    its logging wrapper), else the first torch frame below the script's."""
    marker = f"{os.sep}torch{os.sep}"
    below = frames[frames.index(after) + 1:] if after in frames else frames
    inside = [f for f in below if marker in str(f.get("file"))]
    if not inside:
        return None
    public = next((f for f in inside if str(f.get("file")).endswith("distributed_c10d.py")), None)
    f = public or inside[0]
    module = "torch.distributed" if f"{os.sep}distributed{os.sep}" in str(f.get("file")) else "torch"
    return f"{f.get('func')} ({module})"


def summary(frames: list[dict[str, Any]]) -> str:
    """One line for a main-thread stack: the torch call it waits in, and the script's line that made it."""
    if not frames:
        return "no Python frame (between calls, or starting up)"
    mine = user_frame(frames)
    call = _torch_call(frames, mine)
    at = ""
    if mine is not None:
        code = f" `{mine['code']}`" if mine.get("code") else ""
        at = f"at {Path(str(mine.get('file'))).name}:{mine.get('line')} in {mine.get('func')}{code}"
    return f"in {call} {at}".strip() if call else at


def group(answers: dict[int, RankAnswer]) -> list[Group]:
    """Ranks grouped by identical main-thread stacks; the largest group first, then by first rank."""
    by_key: dict[tuple[Any, ...], Group] = {}
    for rank in sorted(answers):
        a = answers[rank]
        g = by_key.setdefault(_key(a.main), Group([], a.main, summary(a.main)))
        g.ranks.append(rank)
        g.answers.append(a)
    return sorted(by_key.values(), key=lambda g: (-len(g.ranks), g.ranks[0]))


def native_dumps(answers: dict[int, RankAnswer]) -> tuple[dict[int, str], str | None]:
    """``py-spy dump --native`` of each rank's process on this host: {rank: text}, or why there are none."""
    exe = shutil.which("py-spy")
    if exe is None:
        return {}, ("native frames: py-spy is not installed (pip install 'distdebug[native]', or pip install "
                    "py-spy): Python frames only")
    here = socket.gethostname()
    out: dict[int, str] = {}
    problems: list[str] = []
    for rank, a in sorted(answers.items()):
        if a.answer.get("host") != here:
            continue
        try:
            r = subprocess.run([exe, "dump", "--native", "--pid", str(a.answer["pid"])], capture_output=True,
                               text=True, timeout=NATIVE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            problems.append(f"rank {rank}: {type(e).__name__}")
            continue
        if r.returncode == 0:
            # Not its "Process PID: command line" header (the pid is shown already; a command line may hold a
            # secret), and no line past NATIVE_WIDTH (C++ template frames run to thousands of characters).
            kept = [line if len(line) <= NATIVE_WIDTH else line[:NATIVE_WIDTH - 1] + "…"
                    for line in r.stdout.splitlines() if not line.startswith("Process ")]
            out[rank] = "\n".join(kept)
        else:
            problems.append(f"rank {rank}: {(r.stderr or r.stdout).strip().splitlines()[-1:] or ['failed']}")
    note = None
    if problems:
        note = ("native frames: py-spy could not read " + "; ".join(problems)
                + " (it needs ptrace: run as the job's user, or with CAP_SYS_PTRACE)")
    return out, note


def headline(groups: list[Group]) -> str:
    """``ranks 0, 2: in all_reduce (torch.distributed) at train.py:52 ... | rank 1: at train.py:66 ...``."""
    return " | ".join(f"{ranks_text(g.ranks)}: {g.summary}" for g in groups)

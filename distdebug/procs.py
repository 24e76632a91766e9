"""Starting commands that start ranks, and ending them all: also on failure and timeout.

torch's elastic agent starts each worker in a session of its own, so killing a launcher's process
group does not reach its ranks. ``kill_tree`` collects the whole process tree first and kills
each process by pid. Used by the tests, the benchmarks and anything that replays runs.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def kill_tree(pid: int, timeout: float = 10.0) -> None:
    """Kill pid and every descendant (by pid, never by name); wait up to timeout seconds for them."""
    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def run_tree(argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
             cwd: Path | str | None = None) -> Completed:
    """Run argv to completion; at timeout kill its whole tree and return ``timed_out=True``.

    Whatever it leaves running when it ends (orphaned workers) is killed too.
    """
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_tree(proc.pid)
        out, err = proc.communicate()
    finally:
        kill_tree(proc.pid)
    return Completed(proc.returncode, out, err, timed_out)

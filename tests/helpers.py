"""Shared test helpers: run commands with a hard timeout and no process left behind; spawn gloo ranks.

Every process a test starts is ended here, also on failure and timeout: torch's elastic agent
starts workers in sessions of their own, so killing the launcher's group is not enough; the
whole process tree is collected (psutil) and each pid is killed.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from distdebug.procs import Completed, kill_tree, run_tree  # noqa: F401  (kill_tree: re-export)

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
DATA = Path(__file__).resolve().parent / "data"


def make_env(**extra: str) -> dict[str, str]:
    """The environment of a launched command. Each call gets a rendezvous port of its own: torch's
    launcher (torchrun, and attach through it) reads its --master-port default from PET_MASTER_PORT,
    so jobs run side by side (pytest-xdist workers) never meet on torchrun's default port 29500."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", PET_MASTER_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p))
    env.pop("DISTDEBUG_DEBUG", None)
    env.update(extra)
    return env


def run(argv: list[str], *, timeout: float = 120, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> Completed:
    """Run argv to completion (or kill its whole tree at timeout and fail the test)."""
    r = run_tree(argv, timeout=timeout, env=env or make_env(), cwd=cwd or ROOT)
    if r.timed_out:
        raise AssertionError(f"timed out after {timeout}s: {argv}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    return r


JSON_COMMANDS = ("report", "diff", "doctor", "lint", "parity", "top", "stacks")


def distdebug(*args: str, timeout: float = 180, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Completed:
    """A distdebug command, run to completion. Every ``--json`` output of every test is parsed here with a
    strict parser, as a browser's or jq's (issue 63): a bare NaN or Infinity fails the test that made it."""
    r = run([sys.executable, str(ROOT / "cli.py"), *args], timeout=timeout, env=env, cwd=cwd)
    if args and args[0] in JSON_COMMANDS and "--json" in args and r.stdout.strip():
        from distdebug.strictjson import strict_loads

        try:
            strict_loads(r.stdout)
        except ValueError as e:
            raise AssertionError(f"distdebug {' '.join(args[:2])} --json wrote what a strict parser refuses ({e})"
                                 f":\n{r.stdout[:2000]}") from None
    return r


def side_by_side(*commands: list[str], timeout: float = 180) -> list[Completed]:
    """distdebug commands run at once, each with its own rendezvous port; their results in order. For launches
    that leave a core idle alone (a 1-rank run: its launcher waits while its one rank computes; any run's start
    and end): two 1-rank runs take the time of one. Not for a test that judges time (a straggler, a stall, a
    clean run's findings), which crowding changes."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda argv: distdebug(*argv, timeout=timeout), commands))


def torchrun(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> Completed:
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *args], timeout=timeout,
               env=env)


PORTS_FROM, PORTS_A_WORKER, WORKERS_APART = 20000, 2000, 6
_next_port = itertools.count(random.randrange(PORTS_A_WORKER))  # two sessions' same worker start apart
_port_lock = threading.Lock()


def free_port() -> int:
    """A rendezvous port, free now, outside the kernel's ephemeral range and no other pytest worker's.

    A port bound to 0 comes from the ephemeral range (32768-60999 here), which every outgoing connection on the
    host also draws from: the gloo connections of the jobs running beside this one took such a port between its
    pick and the launcher's listen (EADDRINUSE, twice in one CI run). Each xdist worker takes its ports in turn
    from a span of its own below that range, skipping any that cannot be bound now."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    first = PORTS_FROM + (int(worker) % WORKERS_APART if worker.isdigit() else 0) * PORTS_A_WORKER
    with _port_lock:
        for _ in range(PORTS_A_WORKER):
            port = first + next(_next_port) % PORTS_A_WORKER
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
                return port
    raise RuntimeError(f"no free port in {first}..{first + PORTS_A_WORKER - 1}")


def read_digests(out_dir: Path) -> dict[str, str]:
    """rank file -> 'digest final-loss' from recipes/_common.write_digest (the step time is left out)."""
    return {p.name: " ".join(p.read_text().split()[:2]) for p in sorted(out_dir.glob("rank*.txt"))}


# ---------------------------------------------------------------- a small file system that truly fills
@contextlib.contextmanager
def small_fs(where: Path, size_kb: int) -> Iterator[Path]:
    """A tmpfs of ``size_kb`` KiB mounted at ``where`` for the block (a real ENOSPC, not a mock), unmounted
    after it whatever happens. Needs root: skipped, saying so, where mounting is not allowed, unless
    DISTDEBUG_REQUIRE_MOUNT=1 (CI sets it) makes that a failure."""
    import pytest

    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        why = f"cannot mount a tmpfs here ({(r.stderr or r.stdout).strip()}): the full-disk tests need root"
        if os.environ.get("DISTDEBUG_REQUIRE_MOUNT") == "1":
            pytest.fail(why)
        pytest.skip(why)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(fs: Path, leave_kb: int) -> None:
    """Fill ``fs`` with one file of zeros, leaving about ``leave_kb`` KiB free."""
    st = os.statvfs(fs)
    free = st.f_bavail * st.f_frsize - leave_kb * 1024
    if free > 0:
        (fs / "filler").write_bytes(bytes(free))


# ---------------------------------------------------------------- forked gloo ranks (tier 2)
def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, queue: Any, kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo")
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, "ok", fn(rank, world, **kwargs)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., Any], world: int = 2, timeout: float = 60, **kwargs: Any) -> list[Any]:
    """Run fn(rank, world, **kwargs) in `world` forked processes joined by gloo; return results by rank.

    Results must be plain Python values: tensors would travel as shared-memory handles that die
    with the child.

    Fork keeps it cheap (torch is already imported); the process group is made inside each child.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, queue, kwargs)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
    return [results[r] for r in range(world)]


def incidents_of(run_dir: Path) -> list[tuple[str, str, list[str]]]:
    """A run's incidents of warnings and worse: [(root detector, root subject, [member detectors])]."""
    from distdebug.analysis.summary import summarize
    from distdebug.artifacts.reader import load_run

    return [(i.root.detector, i.root.subject, [m.detector for m in i.members])
            for i in summarize(load_run(run_dir)).incidents if i.severity.value != "info"]


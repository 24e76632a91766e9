import fcntl
import os
import sys
import time
from pathlib import Path

import pytest

# Two cores: one thread per rank, and gloo on loopback.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

# DeepSpeed JIT-loads a CPU op (deepspeed_shm_comm) at every engine start, under a lock file in torch's
# extensions directory. Shared by every virtualenv (~/.cache/torch_extensions), two environments
# rebuild it in turn (their build files differ), each build holding the lock for a minute under load;
# and a rank killed while holding it (a test's timeout) leaves the lock behind, on which every later
# DeepSpeed run waits forever. One directory per virtualenv, and a lock older than any build is stale.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
STALE_LOCK_S = 15 * 60


def _remove_stale_locks(root: Path) -> None:
    for lock in root.glob("*/*/lock"):
        try:
            if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                lock.unlink()
                print(f"conftest: removed a stale torch extension build lock: {lock}", file=sys.stderr)
        except OSError:
            pass


_remove_stale_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))


# ---------------------------------------------------------------- tiers, and tests side by side
# Tier 3 (tests/e2e: a real launcher and ranks, seconds each) is `slow` unless a test is marked `smoke`, so
# that -m "not slow" is the quick tier (unit, dist, and one smoke run of each kind through the CLI).
#
# The suite runs on two pytest-xdist workers (pyproject's addopts), but it is CPU-bound: a launch costs
# torch's import in every process (about 8 s of CPU for a launcher and two ranks, measured), so two
# CPU-bound tests side by side finish no sooner, and the crowding is seen by what the tests assert (a
# clean 4-rank run beside another job was called a straggler). What may overlap is a test that mostly
# waits (a stall timeout, a hang verdict, a sleeping rank): marked `waits`, it runs beside one CPU-bound
# test. The rule, held with fcntl locks on two files of the run's (released by the kernel if a worker dies):
# - an unmarked test holds "cpu" exclusively and "all" shared: CPU-bound tests run one at a time;
# - a `waits` test holds "all" shared only: beside any one test but an `alone` one;
# - an `alone` test (it asserts a measured time, such as a straggler's lateness, or runs more ranks than
#   cores and is judged clean) holds "all" exclusively: nothing runs beside it;
# - a tier-1 test (tests/unit: one process, a core at most, no ranks) holds "all" shared only, as a `waits`
#   test: two run at once, or one beside a CPU-bound test, never beside an `alone` one (issue 63: held to
#   "cpu", the 500 unit tests ran one at a time, a core idle).
_E2E = Path(__file__).resolve().parent / "e2e"
_UNIT = Path(__file__).resolve().parent / "unit"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(_E2E) and item.get_closest_marker("smoke") is None:
            item.add_marker(pytest.mark.slow)


def locks_for(alone: bool, waits: bool) -> list[tuple[str, int]]:
    """(lock file, flock mode) a test takes, in this order (every test takes "cpu" before "all": no cycle)."""
    if alone:
        return [("all", fcntl.LOCK_EX)]
    if waits:
        return [("all", fcntl.LOCK_SH)]
    return [("cpu", fcntl.LOCK_EX), ("all", fcntl.LOCK_SH)]


@pytest.fixture(autouse=True)
def side_by_side(request, tmp_path_factory):
    """Hold this test's locks for its duration (see above); nothing to hold in one process."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield
        return
    # Each worker's base temp is <run's temp>/popen-gwN: the folder above is the run's, shared by its workers.
    run = tmp_path_factory.getbasetemp().parent
    node = request.node
    held = []
    try:
        light = Path(str(node.fspath)).is_relative_to(_UNIT)
        for name, mode in locks_for(node.get_closest_marker("alone") is not None,
                                    light or node.get_closest_marker("waits") is not None):
            f = open(run / f"{name}.lock", "a")
            held.append(f)
            fcntl.flock(f, mode)
        yield
    finally:
        for f in reversed(held):
            f.close()  # closing the file releases its lock


# ---------------------------------------------------------------- where the CPU goes
# `python -m pytest --cpu-log FILE` appends one JSON line per test: the CPU seconds of the test's process and
# of every process it started and waited for (launchers and their ranks: RUSAGE_CHILDREN counts the
# descendants reaped below it), and its wall time. A session fixture's run is counted in the first test
# that uses it. This is how the README's figures on the suite's time were measured.
def pytest_addoption(parser):
    parser.addoption("--cpu-log", default=None, metavar="FILE",
                     help="append each test's CPU seconds (itself and the processes it started) to FILE as JSON lines")


def _cpu_seconds() -> tuple[float, float]:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = item.config.getoption("--cpu-log")
    if out is None:
        yield
        return
    import json

    (me0, kids0), t0 = _cpu_seconds(), time.monotonic()
    yield
    me1, kids1 = _cpu_seconds()
    with open(out, "a") as f:  # one short append per test: the workers' lines do not interleave
        f.write(json.dumps({"test": item.nodeid, "self_s": round(me1 - me0, 2), "children_s": round(kids1 - kids0, 2),
                            "wall_s": round(time.monotonic() - t0, 2)}) + "\n")

"""Tier 1 (no processes but one collection): the suite's own rules, so that it stays fast as it grows.

Every end-to-end module says why its tests need their steps and ranks (a "Needs:" paragraph in its
docstring: the reviewer of a new test reads what its runs cost and why); the quick tier
(-m "not slow") is the unit and dist tiers plus the end-to-end tests marked smoke, and nothing else.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

E2E = ROOT / "tests" / "e2e"


def e2e_modules() -> list[Path]:
    return sorted(E2E.glob("test_*.py"))


def test_every_end_to_end_module_says_why_it_needs_its_steps_and_ranks():
    missing = [p.name for p in e2e_modules() if "\nNeeds: " not in "\n" + (ast.get_docstring(ast.parse(p.read_text()))
                                                                             or "")]
    assert e2e_modules() and missing == []


def _smoke_tests() -> set[str]:
    """module::function of every e2e test decorated with pytest.mark.smoke."""
    out = set()
    for p in e2e_modules():
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any("mark.smoke" in ast.unparse(d) for d in node.decorator_list):
                out.add(f"tests/e2e/{p.name}::{node.name}")
    return out


def test_the_quick_tier_is_unit_dist_and_the_smoke_runs():
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p",
                        "no:cacheprovider", "-m", "not slow"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    tiers = {i.split("/")[1] for i in ids}
    assert tiers == {"unit", "dist", "e2e"}
    e2e = {i.split("[")[0] for i in ids if i.startswith("tests/e2e/")}
    smoke = _smoke_tests()
    assert smoke and e2e == smoke  # each smoke test is there, and no other end-to-end test


def _try(path_dir: Path, alone: bool, waits: bool) -> list | None:
    """Take a test's locks without blocking: its open files if it may start now, else None."""
    import fcntl

    from tests.conftest import locks_for

    held = []
    for name, mode in locks_for(alone, waits):
        f = open(path_dir / f"{name}.lock", "a")
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            for g in held:
                g.close()
            return None
        held.append(f)
    return held


def test_cpu_bound_tests_run_one_at_a_time_a_waiting_one_beside_and_an_alone_one_by_itself(tmp_path):
    """The side-by-side rule of tests/conftest.py, on real flocks (each open file is its own holder)."""
    cpu = _try(tmp_path, alone=False, waits=False)
    assert cpu is not None
    assert _try(tmp_path, alone=False, waits=False) is None  # a second CPU-bound test waits
    waiting = _try(tmp_path, alone=False, waits=True)
    assert waiting is not None  # a test that mostly waits runs beside it
    assert _try(tmp_path, alone=True, waits=False) is None  # an alone test waits for both
    for f in cpu + waiting:
        f.close()
    alone = _try(tmp_path, alone=True, waits=False)
    assert alone is not None
    assert _try(tmp_path, alone=False, waits=True) is None and _try(tmp_path, alone=False, waits=False) is None
    for f in alone:
        f.close()


def test_a_rendezvous_port_is_outside_the_ephemeral_range_and_no_other_workers(monkeypatch):
    """The ports of the launches (free_port) are never ones an outgoing connection of a job beside them can take
    meanwhile (the kernel's ephemeral range), nor ones another pytest worker picks, nor bound now."""
    import socket

    from tests import helpers

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = {}
    for worker in ("gw0", "gw1", "gw5"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        picked[worker] = {helpers.free_port() for _ in range(50)}
    assert all(len(ports) == 50 and max(ports) < low for ports in picked.values())
    assert not (picked["gw0"] & picked["gw1"] or picked["gw0"] & picked["gw5"] or picked["gw1"] & picked["gw5"])
    with socket.socket() as held:  # a port in use now is skipped
        monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
        nxt = helpers.free_port() + 1
        held.bind(("", nxt))
        assert helpers.free_port() == nxt + 1

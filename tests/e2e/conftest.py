"""Runs made once per test session and read by every end-to-end test that asserts on them.

A fixture's run is made by the first test that asks for it, under that test's locks (tests/conftest.py);
the tests that share one are put in one xdist group, so that one worker holds the run and makes it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import DATA, Completed, distdebug

HANG_STALL_S = "4"
"""Seconds: short, so that a hang is noticed in seconds. A rank's start-up (imports, init, the first
collectives) may take longer beside a CPU-bound test: the start-up allowance (default 600 s) covers it,
and a test of a start-up hang gives --startup-timeout itself."""
SHARED = "shared-runs"
"""The xdist group of the tests that read a shared run (pytest.mark.xdist_group(SHARED))."""


@dataclass(frozen=True)
class Run:
    run_dir: Path
    result: Completed


@pytest.fixture(scope="session")
def skipped_allreduce_run(tmp_path_factory) -> Run:
    """hang.py on 2 ranks, rank 1 skipping an all_reduce at step 3: the job hangs, attach names rank 1
    after the stall timeout and ends it (exit 124). Read by the hang verdict's test and the HTML report's."""
    run_dir = tmp_path_factory.mktemp("skipped-allreduce") / "run"
    r = distdebug("attach", "--run-dir", str(run_dir), "--stall-timeout", HANG_STALL_S,
                  str(DATA / "scripts" / "hang.py"), "--skip-at", "3", timeout=90)
    return Run(run_dir, r)

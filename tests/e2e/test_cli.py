"""Tier 3 (CLI, no ranks started): help is cheap, bad input is one clear line.

Needs: no ranks: help, the registry and one bad option, each a CLI process alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT, distdebug, make_env


@pytest.mark.smoke
def test_help_does_not_import_torch():
    code = (
        "import sys\nfrom distdebug import cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "heavy = [m for m in ('torch', 'deepspeed', 'rich', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=make_env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "attach" in r.stdout and "report" in r.stdout


@pytest.mark.smoke
def test_python_dash_m_distdebug_is_the_same_command():
    """``python -m distdebug`` (the fault replay's fallback when no cli.py is beside the package)."""
    r = subprocess.run([sys.executable, "-m", "distdebug", "--help"], cwd=ROOT, env=make_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "attach" in r.stdout and "faults" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["attach", "no_such_script.py"], "script not found: no_such_script.py"),
        (["attach", "--no-such-option", "x.py"], "No such option '--no-such-option'"),
        (["attach", "--nproc-per-node", "0", "cli.py"], "--nproc-per-node must be a positive number"),
        (["attach", "--nproc-per-node", "gpu", "cli.py"], "no CUDA GPU on this machine"),
        (["doctor", "--nproc-per-node", "gpu"], "no CUDA GPU on this machine"),
        (["attach", "--nnodes", "2", "cli.py"], "needs a meeting point"),
        (["attach", "--no-python", "cli.py"], "--no-python: distdebug instruments SCRIPT inside each rank's Python"),
        (["attach", "--local-ranks-filter", "a", "cli.py"], "the launcher refused its options: --local_ranks_filter"),
        (["attach", "--detectors", "nope", "cli.py"], "unknown detector 'nope'"),
        (["attach", "--run-dir", "cli.py/run", "cli.py"], "cannot write the run directory"),
        (["report", "no-such-run"], "no run directory 'no-such-run'"),
        (["frobnicate"], "No such command 'frobnicate'"),
    ],
)
@pytest.mark.smoke
def test_bad_input_is_one_line_and_non_zero(args, message, tmp_path):
    (tmp_path / "cli.py").write_text("")  # the script named above, in a folder of its own
    r = distdebug(*args, timeout=60, cwd=tmp_path)
    assert r.returncode != 0
    # Refused before anything is written: no empty run directory, and `latest` not moved to one.
    assert not (tmp_path / "distdebug-runs").exists()
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert message in lines[0] and lines[0].startswith("distdebug: error:")
    assert "Traceback" not in r.output


@pytest.mark.smoke
def test_detectors_lists_the_registry():
    r = distdebug("detectors", timeout=60)
    assert r.returncode == 0 and "loss_nonfinite" in r.stdout

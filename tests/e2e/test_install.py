"""Tier 3 (install end to end): installing distdebug installs distdebug (issue 45, item 7).

The wheel built from this checkout holds one top-level package, ``distdebug`` (fault_injection/ and
recipes/ inside it, as distdebug.fault_injection and distdebug.recipes), so nothing named ``recipes``
lands in site-packages beside a user's own; and in a fresh virtualenv the README's installed-copy
quick start runs, a fault injected from the installed catalogue included.

Needs: pip and the package index (torch==2.13.0 from this machine's disk first, so that no CUDA build
is fetched; the small runtime dependencies from the index): about a minute for the virtualenv, then
one launch of 2 ranks. The editable install and the bare checkout are what every other test runs in."""

from __future__ import annotations

import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

from tests.helpers import ROOT, free_port, run

SOURCES = ("pyproject.toml", "README.md", "distdebug", "fault_injection", "recipes")


def _clean_env() -> dict[str, str]:
    """This environment without the checkout on the path: what the fresh virtualenv sees is what it installed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "DISTDEBUG_DEBUG")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", PET_MASTER_PORT=str(free_port()))
    return env


def test_the_wheel_holds_only_distdebug_and_its_quick_start_runs_in_a_fresh_virtualenv(tmp_path):
    # A copy of the sources: building in the checkout would leave build/ and *.egg-info in a shared tree.
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    env = _clean_env()
    # The build a user's `pip install .` makes (build isolation: pyproject's setuptools), without dependencies.
    r = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheel"), str(src)],
            timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.output[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("distdebug-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/RECORD"))
    assert {n.split("/")[0] for n in names} == {"distdebug", info}
    assert zipfile.ZipFile(wheel).read(f"{info}/top_level.txt").decode().split() == ["distdebug"]
    for path in ("distdebug/fault_injection/registry.py", "distdebug/recipes/ddp_convnet.py",
                 "distdebug/recipes/_common.py", "distdebug/report/assets/report.js", "distdebug/cli/cmd_attach.py"):
        assert path in names, path

    venv = tmp_path / "venv"
    py, bin_ = venv / "bin" / "python", venv / "bin"
    for argv in ([sys.executable, "-m", "venv", str(venv)],
                 [str(py), "-m", "pip", "install", "-q", "torch==2.13.0"],  # first: the CPU build on local disk
                 [str(py), "-m", "pip", "install", "-q", str(wheel)]):
        r = run(argv, timeout=600, env=env, cwd=tmp_path)
        assert r.returncode == 0, r.output[-3000:]

    work = tmp_path / "work"  # not the checkout: its folders would be importable from the current directory
    work.mkdir()
    for name in ("recipes", "fault_injection", "cli"):
        r = run([str(py), "-c", f"import {name}"], env=env, cwd=work)
        assert r.returncode == 1 and f"No module named '{name}'" in r.stderr, (name, r.output[-2000:])
    r = run([str(py), "-c", "import distdebug.fault_injection.registry as f, distdebug.recipes as r; "
             "print(f.FAULTS['nan_grad'].__module__, r.__file__)"], env=env, cwd=work)
    assert r.returncode == 0, r.output[-2000:]
    module, recipes_file = r.stdout.split()
    assert module == "distdebug.fault_injection.nan_grad" and Path(recipes_file).is_relative_to(venv)

    # The README's installed-copy quick start (fewer steps), with a fault from the installed catalogue
    r = run([str(bin_ / "distdebug"), "attach", "--inject", "nan_grad:rank=1,step=2", "-m",
             "distdebug.recipes.ddp_convnet", "--steps", "4"], timeout=300, env=env, cwd=work)
    assert r.returncode == 0, r.output[-3000:]
    rep = run([str(bin_ / "distdebug"), "report", "--json"], env=env, cwd=work)
    assert rep.returncode == 0, rep.output[-3000:]
    findings = json.loads(rep.stdout)["findings"]
    assert any(f["detector"] == "nan_origin" and f["ranks"] == [1] and f["step"] == 2 for f in findings), findings

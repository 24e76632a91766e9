"""Tier 1: every module of distdebug, fault_injection and cli.py imports with only the runtime
dependencies that pyproject.toml declares (and what they require in turn), not the test extras.

A stranger's ``pip install -e .`` has nothing else: a module that imports numpy, deepspeed or
pytest at import time without declaring it fails their first command (it did: numpy). Here each
module is imported in a fresh interpreter whose import system refuses every installed
distribution outside that closure; lazy imports inside functions are allowed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata

import pytest
import tomllib

from tests.helpers import ROOT, make_env


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")


def runtime_closure() -> set[str]:
    """The declared runtime dependencies and, recursively, their own non-extra requirements."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    todo, seen = [_name(r) for r in declared], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in reqs if "extra ==" not in r]
    return seen


def modules() -> list[str]:
    """Every module by the name it is imported under: fault_injection/ is distdebug.fault_injection."""
    names = ["cli"]
    for pkg, name in (("distdebug", "distdebug"), ("fault_injection", "distdebug.fault_injection")):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT / pkg).with_suffix("")
            parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
            names.append(".".join([name, *parts]))
    return names


GUARD = r'''
import importlib, importlib.abc, json, sys
allowed_dists = set(json.loads(sys.argv[1]))
top_to_dists = json.loads(sys.argv[2])
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        dists = top_to_dists.get(top)
        if dists and not any(d in allowed_dists for d in dists):
            raise ModuleNotFoundError(f"No module named {top!r} (not a declared runtime dependency)")
        return None
sys.meta_path.insert(0, Refuse())
failed = []
for mod in json.loads(sys.argv[3]):
    try:
        importlib.import_module(mod)
    except Exception as e:
        failed.append(f"{mod}: {type(e).__name__}: {e}")
print(json.dumps(failed))
'''


@pytest.mark.slow
def test_every_module_imports_with_the_runtime_dependencies_alone():
    allowed = runtime_closure()
    assert {"torch", "click", "rich", "xxhash", "psutil", "numpy"} <= allowed
    assert "deepspeed" not in allowed and "pytest" not in allowed
    top = {k: [d.lower().replace("_", "-") for d in v] for k, v in metadata.packages_distributions().items()
           if k not in ("distdebug", "cli", "fault_injection", "recipes", "tests")}
    mods = modules()
    assert len(mods) > 60
    r = subprocess.run([sys.executable, "-c", GUARD, json.dumps(sorted(allowed)), json.dumps(top), json.dumps(mods)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=make_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


def test_the_guard_refuses_a_test_extra():
    # The check can fail: deepspeed (a test extra, installed here) is refused to an importing module.
    top = {k: list(v) for k, v in metadata.packages_distributions().items()}
    assert "deepspeed" in top, "deepspeed is a test extra and must be installed for the tests"
    r = subprocess.run([sys.executable, "-c", GUARD, json.dumps(sorted(runtime_closure())), json.dumps(top),
                        json.dumps(["deepspeed"])], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=make_env())
    assert "not a declared runtime dependency" in r.stdout, r.stdout + r.stderr


def test_the_console_script_points_into_the_package_and_no_top_level_cli_is_installed():
    # A module called "cli" at the top of site-packages would clash with any other package's.
    (script,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "distdebug"]
    assert script.value == "distdebug.cli:main"
    assert "cli" not in metadata.packages_distributions()
    text = (ROOT / "pyproject.toml").read_text()
    assert 'distdebug = "distdebug.cli:main"' in text and "py-modules" not in text
    # The root cli.py stays a thin entry: it defines nothing of its own.
    root = (ROOT / "cli.py").read_text()
    assert "from distdebug.cli import main" in root and "import click" not in root


def test_the_wheel_lists_every_package_folder_and_installs_one_top_level_name():
    # pyproject lists the packages (find cannot map fault_injection/ and recipes/ into distdebug): a new
    # folder of distdebug's must be listed, or the wheel would ship without it (issue 45, item 7).
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "distdebug").rglob("__init__.py")}
    mapped = setuptools["package-dir"]
    assert mapped == {"distdebug.fault_injection": "fault_injection", "distdebug.recipes": "recipes"}
    assert set(setuptools["packages"]) == folders | set(mapped)
    assert {name.partition(".")[0] for name in setuptools["packages"]} == {"distdebug"}

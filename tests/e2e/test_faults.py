"""Tier 3 (CLI end to end): faults injected from outside real scripts, and the replay matrix that
proves every built detector catches its fault with the right rank, step and subject."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from distdebug.artifacts import layout
from distdebug.artifacts.reader import read_events
from fault_injection.matrix import ENGINES
from fault_injection.registry import FAULTS
from tests.e2e.test_layouts import LAYOUT_RECIPES
from tests.helpers import DATA, RECIPES, distdebug


def records(run_dir, rank, kind):
    return [r for r in read_events(layout.events_path(run_dir, rank))[0] if r["kind"] == kind]


def test_inject_acts_on_an_unmodified_script_and_is_recorded(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path), "--inject", "nan_grad:rank=1,step=4",
                  str(RECIPES / "manual_allreduce.py"), "--steps", "6")
    assert r.returncode == 0, r.output  # the harness reports; the training's exit code passes through
    (inj,) = records(tmp_path, 1, "injected")
    assert (inj["fault"], inj["step"], inj["param"]) == ("nan_grad", 4, "4.weight")
    assert records(tmp_path, 0, "injected") == []
    origin = [f for f in records(tmp_path, 1, "finding") if f["detector"] == "nan_origin"][0]
    assert (origin["ranks"], origin["step"], origin["subject"]) == ([1], 4, "4.weight")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["faults"] == [{"target": "fault_injection.nan_grad:NanGrad", "params": {"rank": 1, "step": 4}}]
    assert "fault injected on purpose: nan_grad on rank 1 at step 4 (param 4.weight)" in \
        distdebug("report", str(tmp_path)).stdout


def test_skip_step_runs_the_closure_it_is_given(tmp_path):
    """optimizer.step(closure) (LBFGS, Lightning's training step): the closure is the forward and backward.
    Skipping the step still runs it (Lightning raises when a closure was not called, issue 22): only the
    update is skipped, and the replicas part at that step."""
    script = str(DATA / "scripts" / "loop_shapes.py")
    r = distdebug("attach", "--run-dir", str(tmp_path), "--inject", "skip_step:rank=1,step=3", script,
                  "--shapes", "closure", "--steps", "8")
    assert r.returncode == 0, r.output[-3000:]
    (inj,) = records(tmp_path, 1, "injected")
    assert (inj["fault"], inj["step"]) == ("skip_step", 3)
    found = [(f["detector"], f["step"], f["subject"], f["ranks"]) for f in records(tmp_path, 0, "finding")]
    assert ("replica_divergence", 3, "optimizer step count", [0, 1]) in found, found


def test_bad_inject_spec_is_one_line_and_nothing_runs(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path / "run"), "--inject", "nan_grad:rnak=1",
                  str(RECIPES / "manual_allreduce.py"))
    assert r.returncode == 2
    assert r.stderr.strip() == ("distdebug: error: --inject nan_grad:rnak=1: fault nan_grad has no parameter "
                                "'rnak'; it takes rank, step, param")
    assert not (tmp_path / "run").exists()
    r = distdebug("faults", "replay", "--fault", "nope")
    assert r.returncode == 2 and "unknown fault 'nope'" in r.stderr and "Traceback" not in r.stderr


DATA_PARALLEL = ("ddp", "manual", "fsdp2", "zero2", "zero2_resume", "doctor")
"""The data-parallel recipes (and the doctor's worker); the layout recipes' replay is in test_layouts."""


def test_replay_of_the_whole_catalogue_on_the_cpu_recipes(tmp_path):
    junit = tmp_path / "faults.xml"
    assert set(DATA_PARALLEL) | set(LAYOUT_RECIPES) == set(ENGINES)  # every recipe is replayed somewhere
    args = [a for e in DATA_PARALLEL for a in ("--recipe", e)]
    r = distdebug("faults", "replay", "--work-dir", str(tmp_path / "runs"), "--junit", str(junit), *args,
                  timeout=1500)
    assert r.returncode == 0, r.output
    cases = {(c.get("classname").split(".", 1)[1], c.get("name")): c for c in ET.parse(junit).getroot()}
    assert {n for _, n in cases} == set(FAULTS) | {"clean"}
    # Every fault on each of its engines: caught with the exact rank, step and subject; every
    # engine's clean run: no finding at all.
    assert {e for e, n in cases if n == "clean"} == {"ddp", "manual", "fsdp2", "zero2", "doctor"}
    for (engine, name), c in cases.items():
        assert c.find("failure") is None, (engine, name, c.find("failure").get("message"))
        assert c.find("system-out").text.startswith("clean" if name == "clean" else "caught-localised"), \
            (engine, name)
    assert ("checkpoint_corruption", "zero2_resume") in {(n, e) for e, n in cases}
    assert ("slow_link", "doctor") in {(n, e) for e, n in cases}
    assert f"{len(cases)} of {len(cases)} cells caught and localised (or clean); 0 missed" in r.stdout


def test_replay_on_the_users_own_script_exits_zero_when_all_caught(tmp_path):
    r = distdebug("faults", "replay", "--fault", "nan_activation", "--fault", "skip_step", "--work-dir",
                  str(tmp_path), str(RECIPES / "manual_allreduce.py"), "--steps", "8", timeout=600)
    assert r.returncode == 0, r.output
    assert "3 of 3 cells caught and localised (or clean)" in r.stdout

"""Tier 3 (end to end): replica divergence under attach, and `distdebug diff` on the run directories.

Needs: 3 ranks where one rank's corruption must be told from two healthy replicas (a majority); 2
elsewhere. 4-5 steps: the flip at step 3 with a step after it, and two runs of the same 4 steps to
compare run against run."""

from __future__ import annotations

import json

from tests.helpers import DATA, distdebug

SCRIPT = str(DATA / "scripts" / "handwritten_allreduce.py")


def attach(run_dir, *args, nproc="2"):
    r = distdebug("attach", "--nproc-per-node", nproc, "--run-dir", str(run_dir), SCRIPT, *args)
    assert r.returncode == 0, r.output
    return r


def test_silent_corruption_on_one_of_three_ranks_online_and_offline(tmp_path):
    r = attach(tmp_path, "--steps", "5", "--flip-at", "3", "--fault-rank", "2", nproc="3")
    assert "replica_divergence: 2.weight: replicas diverged at step 3" in r.stderr
    rep = json.loads(distdebug("report", "--json", str(tmp_path)).stdout)
    (f,) = rep["findings"]
    assert (f["detector"], f["step"], f["subject"], f["ranks"]) == ("replica_divergence", 3, "2.weight", [2])
    # offline: the first divergent step, then the tensors at a step
    d = distdebug("diff", str(tmp_path), "--json")
    assert d.returncode == 1
    out = json.loads(d.stdout)
    assert out["step"] == 3 and [t["tensor"] for t in out["tensors"]] == ["2.weight"]
    assert out["tensors"][0]["ranks"] == [2] and out["tensors"][0]["groups"] == [[0, 1], [2]]
    d2 = distdebug("diff", str(tmp_path), "--step", "2", "--json")
    assert d2.returncode == 0 and json.loads(d2.stdout)["identical"] is True
    text = distdebug("diff", str(tmp_path), "--step", "4")
    assert text.returncode == 1 and "2.weight" in text.stdout and "Replicas differ at step 4" in text.stdout


def test_run_against_run_reproducibility(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    attach(a, "--steps", "4")
    attach(b, "--steps", "4")
    attach(c, "--steps", "4", "--seed", "1")
    same = distdebug("diff", str(a), str(b))
    assert same.returncode == 0 and "bitwise identical" in same.stdout
    other = json.loads(distdebug("diff", str(a), str(c), "--json").stdout)
    assert other["identical"] is False and other["step"] == 1 and other["rank"] == 0
    assert other["tensors"][0]["tensor"] == "0.weight"


def test_diff_without_snapshots_is_a_clear_error(tmp_path):
    r = distdebug("diff", str(tmp_path))
    assert r.returncode == 1 and r.stderr.startswith("distdebug: error: no fingerprint snapshots")

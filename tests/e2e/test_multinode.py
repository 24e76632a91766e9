"""Tier 3 (CLI): a job of two nodes as a cluster's launcher starts it (issue 39, items 3 and 5).

Two launcher agents on this machine, each given only the environment the Kubeflow training operator sets
for torchrun (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT) and each
writing its own run directory, as nodes without a shared file system do; then one report and one diff
across both directories, and another job's directory refused in one line.

Needs: 2 agents x 1 rank (one rank a node); 4 steps of the ConvNet recipe (replica fingerprints at steps
2 and 4, for the diff across nodes).
"""

from __future__ import annotations

import json
import subprocess
import sys

from distdebug.procs import kill_tree
from tests.e2e.test_attach import kinds
from tests.helpers import RECIPES, ROOT, distdebug, free_port, make_env


def test_a_two_node_job_from_pet_variables_with_a_run_directory_per_node_is_one_report(tmp_path):
    port = str(free_port())
    procs = []
    try:
        for node in (0, 1):
            env = make_env(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(node),
                           PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port)
            procs.append(subprocess.Popen(
                [sys.executable, str(ROOT / "cli.py"), "attach", "--run-dir", str(tmp_path / f"node{node}"),
                 "--fail-on", "warning", str(RECIPES / "ddp_convnet.py"), "--steps", "4"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                start_new_session=True))
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            kill_tree(p.pid)
    assert [p.returncode for p in procs] == [0, 0], outs  # --fail-on warning: a clean run passes the gate
    a, b = tmp_path / "node0", tmp_path / "node1"
    for node, run in ((0, a), (1, b)):  # each node's directory holds its own rank only
        (start,) = kinds(run, node, "start")
        assert (start["rank"], start["node"], start["world_size"]) == (node, node, 2)
        assert not (run / f"rank-{1 - node:05d}").exists()
    # One report of both: both ranks, both nodes, the run-level verdicts once, no finding (a clean run)
    r = distdebug("report", "--json", "--fail-on", "warning", str(a), str(b))  # the gate's clean twin: passes
    assert r.returncode == 0, r.output
    report = json.loads(r.stdout)
    assert report["world_size"] == 2 and [x["rank"] for x in report["ranks"]] == [0, 1]
    assert [x["node"] for x in report["ranks"]] == [0, 1] and report["exit_code"] == 0
    assert report["run_dirs"] == [str(a), str(b)]
    assert report["findings"] == [] and report["incidents"] == []
    text = distdebug("report", str(a), str(b))
    assert text.returncode == 0 and "merged from 2 run directories (one per node)" in text.stdout
    html = distdebug("report", "--html", str(tmp_path / "r.html"), str(a), str(b))
    assert html.returncode == 0 and "merged from 2 run directories" in (tmp_path / "r.html").read_text()
    # The replicas compared across the two directories: identical at every checked step
    d = distdebug("diff", "--json", str(a), "--node", str(b))
    assert d.returncode == 0, d.output
    assert json.loads(d.stdout)["ranks"] == [0, 1] and json.loads(d.stdout)["identical"]
    # Another job's directory (one node, another script) is refused in one line, nothing reported
    other = tmp_path / "other"
    assert distdebug("attach", "--nproc-per-node", "1", "--run-dir", str(other), str(RECIPES / "ddp_convnet.py"),
                     "--steps", "2").returncode == 0
    for cmd in (["report", str(a), str(other)], ["diff", str(a), "--node", str(other)]):
        r = distdebug(*cmd)
        assert r.returncode == 1 and r.stdout == "", r.output
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith(f"distdebug: error: {other} is not of the same job as {a} ("), line
    r = distdebug("report", str(a), str(a))
    assert r.returncode == 1 and "rank 0 is in both" in r.stderr

"""Tier 1: one job's run directories, one per node, read as one run; other jobs' refused in one line."""

from __future__ import annotations

import json

import pytest

from distdebug.artifacts import layout
from distdebug.artifacts.reader import load_runs
from distdebug.errors import UserError

LAUNCHER = {"nnodes": "2", "rdzv_backend": "static", "rdzv_endpoint": "", "rdzv_id": "none",
            "master_addr": "10.0.0.1", "master_port": 29500}


def node_dir(root, node, started, ended, launcher=LAUNCHER, args=("--steps", "4")):
    run = root / f"node{node}"
    (run / "nodes").mkdir(parents=True)
    (run / layout.MANIFEST).write_text(json.dumps({"target": "/job/train.py", "target_args": list(args),
                                                   "launcher": launcher, "layout": {str(node): {"node": node}}}))
    layout.node_path(run, node).write_text(json.dumps({"node_rank": node, "started": started, "ended": ended,
                                                       "exit_code": 0}))
    layout.rank_dir(run, node).mkdir()
    layout.events_path(run, node).write_text(json.dumps({"v": 1, "kind": "start", "rank": node, "node": node,
                                                         "world_size": 2}) + "\n")
    return run


def test_one_jobs_nodes_are_one_run(tmp_path):
    a, b = node_dir(tmp_path, 0, 1000.0, 1100.0), node_dir(tmp_path, 1, 1001.0, 1099.0)
    run = load_runs([a, b])
    assert sorted(run.ranks) == [0, 1] and sorted(run.nodes) == [0, 1]
    assert run.paths == [a, b] and run.dir_of(1) == b and run.dir_of(0) == a
    assert run.manifest["layout"] == {"0": {"node": 0}, "1": {"node": 1}}


@pytest.mark.parametrize("change,words", [
    ({"args": ("--steps", "8")}, "(arguments: ['--steps', '8'] against ['--steps', '4'])"),
    ({"launcher": {**LAUNCHER, "master_port": 29600}}, "(rendezvous: 'static 10.0.0.1:29600 id=none' against "
                                                       "'static 10.0.0.1:29500 id=none')"),
    ({"started": 9000.0, "ended": 9100.0}, "their launchers did not run at the same time"),
])
def test_another_jobs_directory_is_refused_in_one_line(tmp_path, change, words):
    a = node_dir(tmp_path, 0, 1000.0, 1100.0)
    times = {"started": change.pop("started", 1001.0), "ended": change.pop("ended", 1099.0)}
    b = node_dir(tmp_path, 1, times["started"], times["ended"], **change)
    with pytest.raises(UserError) as e:
        load_runs([a, b])
    assert str(e.value).startswith(f"{b} is not of the same job as {a}") and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)

"""Tier 3 (CLI): incidents in the report (issue 39, item 4): the issue's own example, end to end.

DDP(broadcast_buffers=False) with BatchNorm: a configuration warning at step 1, bn_divergence errors on
each BatchNorm at step 2, a replica_divergence error on their buffers: one incident, the configuration
first, its fix the configuration's; in the terminal's first screen, --json and --html. (The fault replays'
own cells, one incident each, are checked in test_faults and test_layouts.)

Needs: the DDP ConvNet recipe (2 BatchNorms) for 8 steps (replicas checked at 2, 4 and 8).
"""

from __future__ import annotations

import json

from distdebug.config import EXIT_FINDINGS
from tests.helpers import RECIPES, distdebug


def test_configuration_statistics_and_replicas_are_one_incident_with_the_configuration_first(tmp_path):
    run = tmp_path / "run"
    r = distdebug("attach", "--run-dir", str(run), "--fail-on", "error", str(RECIPES / "ddp_convnet.py"), "--steps",
                  "8", "--no-broadcast-buffers")
    # The training exited 0; --fail-on error gates on its error findings (issue 49, item 5)
    assert r.returncode == EXIT_FINDINGS, r.output
    assert "--fail-on error: " in r.stderr and "finding(s) at or above error: error " in r.stderr, r.output
    report = json.loads(distdebug("report", "--json", str(run)).stdout)
    assert len(report["findings"]) == 4
    (inc,) = report["incidents"]
    assert (inc["severity"], inc["title"]) == ("error", "config_lint: broadcast_buffers")
    assert [(m["detector"], m["subject"]) for m in inc["members"]] == [
        ("config_lint", "broadcast_buffers"), ("bn_divergence", "features.1"), ("bn_divergence", "features.4"),
        ("replica_divergence", "features.1.running_mean")]
    assert inc["fix"] == "keep broadcast_buffers=True, or convert to SyncBatchNorm"
    # each BatchNorm named at the step its statistics first differ, with both ranks
    bn = [(f["subject"], f["step"], f["ranks"]) for f in report["findings"] if f["detector"] == "bn_divergence"]
    assert bn == [("features.1", 2, [0, 1]), ("features.4", 2, [0, 1])], bn
    assert all("advice" in m for m in inc["members"])
    # One causal model for the incident and the advice: what followed is said to be the root's consequence;
    # every finding carries its card's code (issue 49).
    assert [m["code"] for m in inc["members"]] == ["DD504", "DD202", "DD202", "DD201"]
    for m in inc["members"][1:]:
        assert m["advice"]["cause"].startswith("probably a consequence of the configuration from step 1 (DD504 "
                                               "config_lint on broadcast_buffers)"), m["advice"]
    text = distdebug("report", str(run)).stdout
    first = text[:text.index("Findings (4)")]  # the first screen: the incident, before the findings' table
    assert "Incidents (1)" in first and "1. error DD504 config_lint: broadcast_buffers (rank(s) 0,1 step 1)" in first
    assert "then error DD202 bn_divergence features.1 (rank(s) 0,1 step 2)" in first
    assert "fix: keep broadcast_buffers=True, or convert to SyncBatchNorm" in first
    assert "what it means: distdebug explain DD504" in first
    assert distdebug("report", "--html", str(tmp_path / "r.html"), str(run)).returncode == 0
    page = (tmp_path / "r.html").read_text()
    assert "Incidents (1), root cause first" in page and page.index("Incidents (1)") < page.index("Findings (4)")

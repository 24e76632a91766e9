"""Tier 3 (CLI end to end): a torchrun launch line runs under ``distdebug attach`` unchanged, with
torchrun's meaning (issue 45, item 6).

Needs: one launch of 2 ranks (the hand-written all-reduce recipe, 6 steps, a NaN injected on rank 1 so
that distdebug's own findings are there to be seen). Every other torchrun option is proven against
torch's own parser without a launch (tests/unit/test_torchrun_options.py); what only a launch shows is
here: torch's per-rank log files, the console filter, and the run directory beside them."""

from __future__ import annotations

import json

from distdebug.artifacts.reader import load_run
from tests.helpers import RECIPES, distdebug


def test_log_dir_tee_and_local_ranks_filter_mean_what_they_mean_under_torchrun(tmp_path):
    logs, run_dir = tmp_path / "logs", tmp_path / "run"
    # as copied from a torchrun launch script, distdebug's options added
    line = ["--nproc_per_node=2", "--log-dir", str(logs), "--tee", "3", "--local-ranks-filter", "0"]
    r = distdebug("attach", *line, "--run-dir", str(run_dir), "--inject", "nan_grad:rank=1,step=4",
                  str(RECIPES / "manual_allreduce.py"), "--steps", "6", cwd=tmp_path)
    assert r.returncode == 0, r.output[-3000:]

    # --tee 3 --local-ranks-filter 0: rank 0's streams on the console, prefixed as torchrun does; rank 1's not
    assert "[default0]:rank 0: final loss" in r.stdout
    assert "rank 1:" not in r.output and "[default1]" not in r.output
    assert "[default0]:distdebug[rank 0]" in r.stderr  # distdebug's rank lines are the rank's output too
    # --log-dir: torch's per-rank files, every rank's (the filter is for the console only)
    (job,) = logs.iterdir()
    files = sorted(str(p.relative_to(job)) for p in job.rglob("*.log"))
    assert files == [f"attempt_0/{rank}/{stream}.log" for rank in (0, 1) for stream in ("stderr", "stdout")]
    assert "rank 1: final loss" in (job / "attempt_0" / "1" / "stdout.log").read_text()
    assert "distdebug[rank 1]" in (job / "attempt_0" / "1" / "stderr.log").read_text()

    # distdebug's own run directory is as without them: the NaN placed on rank 1, the options recorded
    run = load_run(run_dir)
    origin = [f for f in run.all_findings() if f["detector"] == "nan_origin" and f["ranks"] == [1]]
    assert origin and origin[0]["step"] == 4, run.all_findings()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["launcher"]["torchrun_args"] == ["--log-dir", str(logs), "--tee", "3", "--local-ranks-filter", "0"]
    assert "started on rank 1" in " ".join(distdebug("report", str(run_dir)).stdout.split())

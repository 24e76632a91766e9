"""Tier 1: the analysis stage on golden run directories (tests/data/golden/<case>/run, written by
real ranks with a fault injected) must reach the verdicts in <case>/expected.json. An analysis
change is checked here without starting a rank (issue 19)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from distdebug.analysis.after_job import JobEnd, analyse
from distdebug.analysis.diff import first_divergent_step, load_snapshots
from distdebug.analysis.hang import diagnose
from distdebug.analysis.summary import summarize
from distdebug.artifacts import layout, schema
from distdebug.artifacts.reader import load_run
from distdebug.detectors.straggler import verdicts
from distdebug.fingerprint.compare import divergence_finding
from tests.unit.test_layout_readme import matches_layout

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
CASES = ("hang", "replica_divergence", "nan_origin", "straggler")


def expected(case: str) -> dict:
    return json.loads((GOLDEN / case / "expected.json").read_text())


def check(finding, want: dict) -> None:
    got = (finding.detector, finding.ranks, finding.step, finding.subject)
    assert got == (want["detector"], want["ranks"], want["step"], want["subject"])
    for text in want["message_contains"]:
        assert text in finding.message, finding.message


def test_hang_verdict_from_the_ranks_records_inflight_slots_and_flight_recorder():
    (f,) = diagnose(load_run(GOLDEN / "hang" / "run"))
    check(f, expected("hang"))


def test_replica_divergence_offline_has_the_online_rule_and_wording():
    run_dir = GOLDEN / "replica_divergence" / "run"
    snaps = load_snapshots(run_dir)
    step, diffs = first_divergent_step(snaps)
    offline = divergence_finding(step, [d.to_dict() for d in diffs], sum(1 for s in snaps.values() if step in s),
                                 after_job=True)
    check(offline, expected("replica_divergence"))
    (online,) = [f for f in summarize(load_run(run_dir)).findings if f.detector == "replica_divergence"]
    check(online, expected("replica_divergence"))
    assert offline.message.replace(" (found from the snapshots after the job)", "") == online.message


def test_the_pass_after_the_job_finds_what_the_online_check_did_not_exchange(tmp_path):
    # The same run as if the ranks had died before their exchange: no online finding, snapshots on disk.
    run_dir = tmp_path / "run"
    shutil.copytree(GOLDEN / "replica_divergence" / "run", run_dir)
    for events in run_dir.glob("rank-*/events.jsonl"):
        kept = [line for line in events.read_text().splitlines() if f'"kind":"{schema.FINDING}"' not in line]
        events.write_text("\n".join(kept) + "\n")
    result = analyse(run_dir, JobEnd(exit_code=0))
    (f,) = result.findings
    check(f, expected("replica_divergence"))
    assert "(found from the snapshots after the job)" in f.message
    assert result.world_size == 3 and sorted(result.layout) == ["0", "1", "2"]
    written = [json.loads(line) for line in layout.run_findings_path(run_dir).read_text().splitlines()]
    assert [(x["detector"], x["ranks"], x["step"]) for x in written] == [("replica_divergence", [2], 3)]
    assert analyse(GOLDEN / "hang" / "run", JobEnd(exit_code=124, hang_named=True, primary=False)).findings == []


def test_nan_origin_the_rank_it_started_on_comes_first_in_the_report():
    want = expected("nan_origin")
    findings = summarize(load_run(GOLDEN / "nan_origin" / "run")).findings
    check(findings[0], want)
    got = {(f.detector, tuple(f.ranks), f.step, f.subject) for f in findings}
    assert {(d, tuple(r), s, subj) for d, r, s, subj in want["also"]} <= got


def test_straggler_verdict_from_the_recorded_scores():
    want = expected("straggler")
    run = load_run(GOLDEN / "straggler" / "run")
    scored = [r for r in run.ranks[0].records if r.get("kind") == schema.STRAGGLER_SCORES and r["step"] == want["step"]]
    table = {int(k): v for k, v in scored[-1]["ranks"].items()}
    assert [(rank, cause) for rank, cause, _ in verdicts(table)] == [(want["ranks"][0], want["cause"])]
    (f,) = [f for f in summarize(run).findings if f.detector == "straggler"]
    check(f, want)


@pytest.mark.parametrize("case", CASES)
def test_every_file_of_a_golden_run_is_in_the_layout(case):
    files = [p.relative_to(GOLDEN / case / "run").as_posix() for p in (GOLDEN / case / "run").rglob("*")
             if p.is_file()]
    assert len(files) >= 8
    assert [f for f in files if not matches_layout(f)] == []

"""Tier 1 (pure): the report's knowledge base (the seed's symptom table), the out-of-memory diagnosis,
the plot data at 1 to 1000 ranks, and the HTML file being self-contained, on synthetic run directories
with planted faults (tests/synthetic.py)."""

from __future__ import annotations

import html
import json
import math
import re

from click.testing import CliRunner

from distdebug import cards
from distdebug.analysis.errors import error_findings, oom_phase
from distdebug.analysis.incidents import group
from distdebug.analysis.plots import MAX_BARS, MAX_ROWS, MAX_STEPS, plot_data
from distdebug.analysis.summary import summarize
from distdebug.artifacts.reader import load_run
from distdebug.cli import main as cli_main
from distdebug.findings import Finding, Severity
from distdebug.report import knowledge as kb
from distdebug.report.console import notable_ranks
from distdebug.report.html import render_html
from distdebug.report.knowledge import findings_with_advice
from tests.synthetic import write_run


def finding(detector, step=5, ranks=(1,), subject="x", severity=Severity.ERROR, message="m", **evidence):
    return Finding(severity=severity, detector=detector, ranks=list(ranks), step=step, subject=subject,
                   message=message, evidence=evidence)


def test_every_row_of_the_seed_symptom_table_is_reached():
    rows = {
        kb.LOSS_X10: kb.advise(finding("loss_spike", value=30.0, median=2.0)),
        kb.SLOW: kb.advise(finding("straggler", cause="data loader")),
        kb.LOSSES_DIFFER: kb.advise(finding("bn_divergence")),
        kb.OOM_FORWARD: kb.advise(finding("oom", phase="forward")),
        kb.RESTORE: kb.advise(finding("checkpoint_roundtrip")),
    }
    for symptom, advice in rows.items():
        assert advice.symptom == symptom and advice.cause and advice.fix
    assert "data loading" in rows[kb.SLOW].cause and "DataLoader workers" in rows[kb.SLOW].fix
    assert "activations" in rows[kb.OOM_FORWARD].cause
    assert "compute" in kb.advise(finding("straggler", cause="compute")).cause


def test_context_decides_the_cause():
    # A rank whose loss departs from the others' is the "ranks' losses differ" row, not "loss x10".
    departs = kb.advise(finding("loss_spike", median_of_other_ranks=0.3, value=9.0))
    assert departs.symptom == kb.LOSSES_DIFFER and "BatchNorm" in departs.cause
    # A loss jump after a checkpoint restore: shards restored wrongly.
    restore, spike = finding("checkpoint_roundtrip", step=40), finding("loss_spike", step=42, value=9.0, median=1.0)
    assert [a.symptom for a in kb.advise_all([restore, spike])] == [kb.RESTORE, kb.RESTORE]
    assert kb.advise_all([spike])[0].symptom == kb.LOSS_X10
    # The rank that only received the NaN through all-reduce is told so, not blamed.
    received = kb.advise(finding("nan_origin", ranks=(0,), subject="gradients", origin="another rank"))
    assert "only received" in received.cause
    # After the first NaN, a BatchNorm divergence is its consequence; before it, a cause of its own.
    nan, bn_after, bn_before = finding("nan_origin", step=12), finding("bn_divergence", step=16), \
        finding("bn_divergence", step=8)
    advice = kb.advise_all([nan, bn_after, bn_before])
    assert "consequence of the NaN/Inf from step 12" in advice[1].cause
    assert "consequence" not in advice[2].cause
    # Replicas that part in the NaN's own step (a TP peer's replicated bias: NaN on one rank, finite on
    # the other) part because of it; so does a BatchNorm whose running statistics took the NaN in that step's
    # forward (one causal model, cards.kinds, for the incidents and the advice: they agree).
    same_div, same_bn = finding("replica_divergence", step=12), finding("bn_divergence", step=12)
    advice = kb.advise_all([nan, same_div, same_bn])
    assert "consequence of the NaN/Inf from step 12" in advice[1].cause
    assert "consequence of the NaN/Inf from step 12" in advice[2].cause
    (incident,) = group([nan, same_div, same_bn])
    assert incident.root is nan and {id(m) for m in incident.consequences()} == {id(same_div), id(same_bn)}
    # ... but only what a NaN can cause: identical batches across ranks, a seed or a config trap after it
    # keep their own cause.
    data_after = finding("data_order", step=16)
    seed_after = finding("init_seed", step=16, subject="torch.manual_seed")
    for a in kb.advise_all([nan, data_after, seed_after])[1:]:
        assert "consequence" not in a.cause, a
    # A seed note is about reproducing runs, not about replicas; after a restored checkpoint, an
    # init_seed difference is the checkpoint's.
    assert kb.advise(seed_after).symptom == kb.REPRODUCE
    restore0, differ = finding("checkpoint_roundtrip", step=0), finding("init_seed", step=0, subject="w")
    assert "restored different values from a checkpoint" in kb.advise_all([restore0, differ])[1].cause
    assert "seeds not fixed" in kb.advise_all([differ])[0].cause
    # BatchNorm statistics on replicas that already diverged are the divergence's consequence, not a
    # reason for SyncBatchNorm.
    div, bn_later = finding("replica_divergence", step=3), finding("bn_divergence", step=4)
    later = kb.advise_all([div, bn_later])[1]
    assert "consequence of the replica divergence from step 3" in later.cause and "SyncBatchNorm" not in later.fix
    # ... and the fix the report prints is the root's to fix first, even where the finding has its own
    assert later.consequence_of == "DD201 replica_divergence at step 3"
    assert kb.shown_fix("use SyncBatchNorm", later) == later.fix and kb.shown_fix("own", kb.advise(div)) == "own"
    # The seed is wrong about clipping after DDP: the advice follows PyTorch.
    assert "no rescaling" in kb.advise(finding("loss_nonfinite")).fix


def test_out_of_memory_is_placed_in_forward_backward_or_step():
    fwd = [{"func": "<module>", "code": "out = model(x)"}, {"func": "forward", "code": "h = self.big(x)"}]
    bwd = [{"func": "<module>", "code": "loss.backward()"}, {"func": "backward", "code": "_engine_run_backward("}]
    stp = [{"func": "<module>", "code": "opt.step()"}, {"func": "_init_group", "code": "torch.zeros_like(p)"}]
    assert [oom_phase(s) for s in (fwd, bwd, stp)] == ["forward", "backward", "step"]
    [f] = error_findings(3, {"exception": "OutOfMemoryError", "message": "CUDA out of memory. Tried to allocate 2 GiB",
                           "step": 6, "stack": fwd})
    assert (f.detector, f.ranks, f.step, f.subject) == ("oom", [3], 7, "out of memory in forward")
    assert kb.advise(f).symptom == kb.OOM_FORWARD
    assert error_findings(0, {"exception": "ValueError", "message": "bad shape", "stack": fwd}) == []


def test_plot_data_for_1000_ranks_is_aggregated_and_keeps_the_planted_faults(tmp_path):
    run_dir = write_run(tmp_path / "run", ranks=1000, steps=40, slow_rank=537, nan_rank=811, nan_step=30,
                        killed=(3, 999), killed_at=20)
    run = load_run(run_dir)
    summary = summarize(run)
    findings = findings_with_advice(summary.findings)
    d = plot_data(run, summary, findings)
    assert d["first_bad"] == {"step": 30, "detectors": ["nan_origin"], "ranks": [811],
                              "subject": "layers.7.mlp.weight"}
    # Loss: the spread over ranks, plus the ranks that findings name.
    assert d["loss"]["mode"] == "band" and d["loss"]["ranks"] == 1000
    assert [s["rank"] for s in d["loss"]["series"]] == [537, 811]
    assert math.isnan(d["loss"]["series"][1]["y"][29]) and math.isfinite(d["loss"]["series"][1]["y"][28])
    # Heatmap: at most MAX_ROWS rows; the slow rank's group is the slowest row.
    st = d["step_time"]
    assert len(st["rows"]) <= MAX_ROWS and st["group"] == 8
    slowest = max(range(len(st["rows"])), key=lambda i: sum(v for v in st["values_ms"][i] if v))
    assert st["rows"][slowest] == "ranks 536-543"
    assert st["values_ms"][slowest][5] / st["median_ms"] > 2
    # Memory and straggler bars: grouped, each group's worst rank named.
    assert len(d["memory"]["rows"]) <= MAX_BARS and d["memory"]["rows"][-1]["label"].endswith("(max: rank 999)")
    low = min(d["straggler"]["rows"], key=lambda r: r["score"])
    assert low["score"] == 0.4 and low["label"].endswith("(min: rank 537)")
    # The killed ranks are in the timeline, at their last step.
    assert {(e["rank"], e["step"]) for e in d["timeline"]["ends"]} == {(3, 20), (999, 20)}


def test_steps_are_binned_and_a_nan_survives_binning(tmp_path):
    run_dir = write_run(tmp_path / "run", ranks=2, steps=2 * MAX_STEPS + 7, nan_step=700)
    run = load_run(run_dir)
    summary = summarize(run)
    d = plot_data(run, summary, findings_with_advice(summary.findings))
    # 1,007 steps: each rank's curve holds 2-step buckets (at most 512 of them), a bin 2 of those
    assert d["steps"]["bin"] == 4 and len(d["steps"]["starts"]) <= MAX_STEPS
    y = d["loss"]["series"][0]["y"]
    i = (700 - 1) // 4  # the bin that holds step 700
    assert math.isnan(y[i]) and math.isfinite(y[i - 1])
    assert d["loss"]["mode"] == "per_rank" and len(d["loss"]["series"]) == 2


def test_html_is_one_self_contained_file(tmp_path):
    run_dir = write_run(tmp_path / "run", ranks=1000, steps=40, slow_rank=5, nan_rank=7, nan_step=30)
    run = load_run(run_dir)
    out = render_html(run, summarize(run), tmp_path / "out" / "report.html")
    page = out.read_text()
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    assert not re.search(r"""(src|href)=['"]?(https?:)?//""", page)
    assert len(page) < 3_000_000
    data = json.loads(re.search(r'<script type="application/json" id="distdebug-data">(.*?)</script>', page,
                                re.S).group(1))
    assert data["first_bad"]["step"] == 30 and "NaN" in json.dumps(data["loss"])
    assert "First bad step: 30" in page and "likely cause" in page
    assert "1000 ranks (" in page  # the rank table folds at this size


def test_report_cli_writes_html_and_json_advice(tmp_path):
    run_dir = write_run(tmp_path / "run", ranks=3, steps=30, slow_rank=2)
    out = tmp_path / "r.html"
    r = CliRunner().invoke(cli_main, ["report", str(run_dir), "--json", "--html", str(out)],
                           catch_exceptions=False, standalone_mode=False)
    assert r.exit_code == 0 and out.is_file()
    d = json.loads(r.stdout)
    [f] = d["findings"]
    assert f["detector"] == "straggler" and f["advice"]["symptom"] == kb.SLOW
    # Every finding carries its card's code: in the JSON, in the text report, and in the HTML as a link to
    # the card at the foot of the page (which is there, with the card's own words).
    assert f["code"] == "DD401" and d["incidents"][0]["root"]["code"] == "DD401"
    page = out.read_text()
    assert "href='#DD401'>DD401</a>" in page and '<section class="card" id="DD401">' in page
    assert html.escape(cards.CARDS["straggler"].meaning) in page
    text = CliRunner().invoke(cli_main, ["report", str(run_dir)], env={"COLUMNS": "200"}).output
    assert "DD401 straggler" in text and "distdebug explain DD401" in text


def test_terminal_rank_table_keeps_the_ranks_worth_a_look_at_scale(tmp_path):
    run = load_run(write_run(tmp_path / "run", ranks=200, steps=20, slow_rank=150, killed=(42,), killed_at=10))
    shown = [r.rank for r in notable_ranks(summarize(run))]
    assert 150 in shown and 42 in shown and 0 in shown and len(shown) <= 32
    small = load_run(write_run(tmp_path / "small", ranks=4, steps=5))
    assert [r.rank for r in notable_ranks(summarize(small))] == [0, 1, 2, 3]


def test_unwritable_html_path_is_one_line_and_non_zero(tmp_path):
    from tests.helpers import distdebug

    run_dir = write_run(tmp_path / "run", ranks=2, steps=3)
    r = distdebug("report", str(run_dir), "--html", str(tmp_path / "missing" / "dir" / "x.html"), timeout=60)
    assert r.returncode == 0  # parents are created
    (tmp_path / "file").write_text("")
    r = distdebug("report", str(run_dir), "--html", str(tmp_path / "file" / "x.html"), timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("distdebug: error: --html ")


def test_messages_that_look_like_markup_are_printed_as_text(tmp_path):
    # gloo's errors quote source paths in brackets, which rich would read as closing tags.
    from distdebug.artifacts import layout, schema
    from tests.helpers import distdebug

    run_dir = write_run(tmp_path / "run", ranks=2, steps=3)
    text = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed by peer"
    with open(layout.events_path(run_dir, 0), "a") as f:
        f.write(json.dumps(schema.record(schema.FINDING, severity="error", detector="harness", ranks=[0], step=2,
                                         subject="[bold]x[/]", message=text)) + "\n")
        f.write(json.dumps(schema.record(schema.SCRIPT_ERROR, rank=0, step=2, exception="RuntimeError",
                                         message=text, stack=[])) + "\n")
    r = distdebug("report", str(run_dir), "--html", str(tmp_path / "r.html"), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "pair.cc:537]" in r.stdout and "[bold]x[/]" in r.stdout
    assert "pair.cc:537] Connection closed" in (tmp_path / "r.html").read_text()


def test_report_fail_on_gates_on_the_worst_finding_and_its_clean_twin_passes(tmp_path):
    """``report --fail-on LEVEL`` (issue 49, item 5): exit 121 and one line naming what failed when a finding of
    that severity or worse is there; 0 below it and on the clean twin; distdebug's own harness findings never
    count. The report itself is printed as always."""
    from distdebug.config import EXIT_FINDINGS
    from distdebug.findings import at_or_above, gate_line

    faulty = write_run(tmp_path / "faulty", ranks=3, steps=30, slow_rank=2, nan_rank=1, nan_step=12)
    clean = write_run(tmp_path / "clean", ranks=3, steps=30)

    def run(*args):
        return CliRunner().invoke(cli_main, ["report", *args], catch_exceptions=False)

    r = run("--fail-on", "error", str(faulty))
    assert r.exit_code == EXIT_FINDINGS and "Findings" in r.stdout
    assert "--fail-on error: 1 finding(s) at or above error: error nan_origin" in r.stderr
    assert "at step 12 on rank(s) 1; exit 121" in r.stderr
    assert run("--fail-on", "warning", "--json", str(faulty)).exit_code == EXIT_FINDINGS
    assert run("--fail-on", "critical", str(faulty)).exit_code == 0  # nothing critical there
    assert run(str(faulty)).exit_code == 0  # no gate asked: a report is not a verdict on the run
    for level in ("warning", "error", "critical"):
        assert run("--fail-on", level, str(clean)).exit_code == 0
    bad = run("--fail-on", "info", str(faulty))
    assert bad.exit_code == 2 and "'info' is not one of 'warning', 'error', 'critical'" in bad.stderr
    harness = finding("harness", subject="detector:x", severity=Severity.CRITICAL)
    spike = finding("loss_spike", severity=Severity.WARNING)
    assert at_or_above([harness, spike], "warning") == [spike] and at_or_above([harness], "error") == []
    many = [finding("nan_origin", step=s) for s in range(5)]
    assert gate_line("error", many).endswith("; and 2 more")

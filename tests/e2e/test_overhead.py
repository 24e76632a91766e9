"""Tier 3 (CLI): what attaching costs, seen by the user in every run and measured inside the job (issue 18).

Every run's report carries the harness's own accounting (``harness cost per step``; ``--json`` under
``harness_cost``: the steady cost per step, and what was paid once apart). ``attach --measure-overhead``
switches the detectors off and on in pairs of steps, one with and one without, the order drawn per pair,
the same steps on every rank, and the report gives the overhead of the wall time and of the training
thread's CPU time, each with its interval (``--json`` under ``overhead``); training is bitwise what
torchrun gives, and no finding comes from a step being off.

Needs: 2 ranks; 26 steps: 2 warm-up steps and 12 on/off pairs; 10 steps for the per-run accounting.
"""

from __future__ import annotations

import json

from distdebug.runtime.overhead import on_first
from tests.e2e.test_attach import kinds
from tests.helpers import RECIPES, distdebug, read_digests, torchrun

CONVNET = str(RECIPES / "ddp_convnet.py")


def test_measure_overhead_pairs_steps_on_every_rank_and_reports_an_interval(tmp_path):
    # over 26 steps: steps 1-2 warm (on), then 12 pairs of steps from step 3, one on and one off each, the
    # order drawn per pair (runtime.overhead.on_first: the pair's number alone)
    r = torchrun(CONVNET, "--steps", "26", "--digest-out", str(tmp_path / "bare"))
    assert r.returncode == 0, r.output
    r = distdebug("attach", "--measure-overhead", "--overhead-block", "1", "--run-dir", str(tmp_path / "run"),
                  CONVNET, "--steps", "26", "--digest-out", str(tmp_path / "attached"), timeout=300)
    assert r.returncode == 0, r.output
    assert read_digests(tmp_path / "attached") == read_digests(tmp_path / "bare")  # the A/B changes no result
    off = [3 + 2 * k + (1 if on_first(k) else 0) for k in range(12)]
    assert {s - 2 * ((s - 3) // 2) for s in off} == {3, 4}  # both orders drawn in these 12 pairs
    for rank in (0, 1):
        steps = kinds(tmp_path / "run", rank, "step")
        assert [s["step"] for s in steps if s.get("harness") == "off"] == off  # the same steps on every rank
        assert all(s["loss"] is None for s in steps if s.get("harness") == "off")  # nothing read when off
        pairs = kinds(tmp_path / "run", rank, "overhead_block")
        assert [(b["block"], b["on_first"], b["last_step"]) for b in pairs] == \
            [(k, on_first(k), 4 + 2 * k) for k in range(12)]
        assert all(len(b["on_s"]) == len(b["off_s"]) == len(b["on_cpu_s"]) == len(b["off_cpu_s"]) == 1
                   for b in pairs)
    data = json.loads(distdebug("report", "--json", str(tmp_path / "run")).stdout)
    assert data["findings"] == []  # no finding from a block being off
    o = data["overhead"]
    assert (o["steps"], o["pairs"], o["rank"], o["unit"]) == (24, 12, 0, 1) and len(o["ci"]) == 2
    assert o["ci"][0] <= o["fraction"] <= o["ci"][1] and set(o["ranks"]) == {"0", "1"}
    assert o["cpu_ci"][0] <= o["cpu_fraction"] <= o["cpu_ci"][1]
    assert o["step_ms_off"] > 0 and o["step_ms_on"] > 0 and o["cpu_step_ms_off"] > 0
    # The self-accounting counts the steps the detectors ran: one host read each.
    cost = data["harness_cost"]["ranks"]["0"]
    assert cost["steps"] == 13 and cost["host_reads_per_step"] == 1.0  # step 2 and the 12 on steps
    text = " ".join(distdebug("report", str(tmp_path / "run")).stdout.split())
    assert "harness overhead " in text and "(95% CI " in text and "over 24 steps (12 on/off pairs of 1 step" in text
    assert "the training thread's CPU time " in text
    # what the off steps still paid the session is measured and added: the figure against a run without us
    assert 0 < o["off_paid_ms"] and o["paid_ms"] == round(o["cpu_per_step_ms"] + o["off_paid_ms"], 4)
    assert f"against a run without distdebug {o['paid_ms']:.3f} ms a step" in text


def test_every_run_reports_what_the_harness_cost_it(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path / "run"), str(RECIPES / "manual_allreduce.py"), "--steps", "10")
    assert r.returncode == 0, r.output
    data = json.loads(distdebug("report", "--json", str(tmp_path / "run")).stdout)
    cost = data["harness_cost"]
    assert set(cost["ranks"]) == {"0", "1"}
    for rank in ("0", "1"):
        c = cost["ranks"][rank]
        assert c["steps"] == 9 and c["host_reads_per_step"] == 1.0 and c["median_step_ms"] > 0
        # every default detector that does per-step work is named, the session too; start-up apart
        assert {"session", "nan_origin", "replica_divergence", "loss_spike"} <= set(c["per_step_ms"])
        assert c["total_per_step_ms"] > 0 and c["startup_ms"] > 0
        assert abs(sum(c["per_step_ms"].values()) - c["total_per_step_ms"]) < 0.01
    (record,) = kinds(tmp_path / "run", 0, "harness_cost")[-1:]
    assert record["steps"] == 9 and "distdebug-exchange" in record["threads_cpu_ms"]
    text = " ".join(distdebug("report", str(tmp_path / "run")).stdout.split())
    assert f"harness cost per step (rank {cost['rank']}, over 9 steps), steady: " in text
    assert "host reads 1 per step" in text and "paid once: start-up (step 1) " in text
    assert "ms a step over the whole run" in text
    html = tmp_path / "report.html"
    assert distdebug("report", "--html", str(html), str(tmp_path / "run")).returncode == 0
    page = html.read_text()
    assert "<h2>Harness cost per step</h2>" in page and "<th>nan_origin</th>" in page


def test_a_unit_of_no_step_is_a_clear_error(tmp_path):
    r = distdebug("attach", "--measure-overhead", "--overhead-block", "0", "--run-dir", str(tmp_path / "run"),
                  CONVNET)
    assert r.returncode == 2
    assert r.stderr.strip() == "distdebug: error: --overhead-block 0: give 1 step or more per unit"
    assert not (tmp_path / "run").exists()

"""Tier 3 (CLI): what attaching costs, seen by the user in every run and measured inside the job (issue 18).

Every run's report carries the harness's own accounting (``harness cost per step``; ``--json`` under
``harness_cost``). ``attach --measure-overhead`` switches the detectors off and on in alternating
blocks of steps, the same steps on every rank, and the report gives the overhead with its interval
(``--json`` under ``overhead``); training is bitwise what torchrun gives, and no finding comes from a
block being off.

Needs: 2 ranks; 26 steps: 2 warm-up steps and 3 on/off block pairs of 4 steps (the fewest that give an
interval); 10 steps for the per-run accounting.
"""

from __future__ import annotations

import json

from tests.e2e.test_attach import kinds
from tests.helpers import RECIPES, distdebug, read_digests, torchrun

CONVNET = str(RECIPES / "ddp_convnet.py")


def test_measure_overhead_alternates_blocks_on_every_rank_and_reports_an_interval(tmp_path):
    # --overhead-block 4 over 26 steps: steps 1-2 warm (on), then blocks of 4 from step 3, on first:
    # on 3-6, 11-14, 19-22; off 7-10, 15-18, 23-26.
    r = torchrun(CONVNET, "--steps", "26", "--digest-out", str(tmp_path / "bare"))
    assert r.returncode == 0, r.output
    r = distdebug("attach", "--measure-overhead", "--overhead-block", "4", "--run-dir", str(tmp_path / "run"),
                  CONVNET, "--steps", "26", "--digest-out", str(tmp_path / "attached"), timeout=300)
    assert r.returncode == 0, r.output
    assert read_digests(tmp_path / "attached") == read_digests(tmp_path / "bare")  # the A/B changes no result
    off = [s for s in range(1, 27) if s >= 7 and (s - 3) // 4 % 2 == 1]
    assert off == [7, 8, 9, 10, 15, 16, 17, 18, 23, 24, 25, 26]
    for rank in (0, 1):
        steps = kinds(tmp_path / "run", rank, "step")
        assert [s["step"] for s in steps if s.get("harness") == "off"] == off
        assert all(s["loss"] is None for s in steps if s.get("harness") == "off")  # nothing read when off
        blocks = kinds(tmp_path / "run", rank, "overhead_block")
        assert [(b["block"], b["on"], len(b["step_times_s"])) for b in blocks] == \
            [(i, i % 2 == 0, 4) for i in range(6)]
    data = json.loads(distdebug("report", "--json", str(tmp_path / "run")).stdout)
    assert data["findings"] == []  # no finding from a block being off
    o = data["overhead"]
    assert (o["steps"], o["pairs"], o["rank"]) == (24, 3, 0) and len(o["ci"]) == 2
    assert o["ci"][0] <= o["fraction"] <= o["ci"][1] and set(o["ranks"]) == {"0", "1"}
    assert o["step_ms_off"] > 0 and o["step_ms_on"] > 0
    # The self-accounting counts the steps the detectors ran: one host read each.
    cost = data["harness_cost"]["ranks"]["0"]
    assert cost["steps"] == 13 and cost["host_reads_per_step"] == 1.0  # steps 2-6, 11-14, 19-22
    text = " ".join(distdebug("report", str(tmp_path / "run")).stdout.split())
    assert "harness overhead " in text and "(95% CI " in text and "over 24 steps (3 on/off block pairs" in text


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
    assert f"harness cost per step (rank {cost['rank']}, over 9 steps): " in text
    assert "host reads 1 per step" in text
    html = tmp_path / "report.html"
    assert distdebug("report", "--html", str(html), str(tmp_path / "run")).returncode == 0
    page = html.read_text()
    assert "<h2>Harness cost per step</h2>" in page and "<th>nan_origin</th>" in page


def test_a_block_of_one_step_is_a_clear_error(tmp_path):
    r = distdebug("attach", "--measure-overhead", "--overhead-block", "1", "--run-dir", str(tmp_path / "run"),
                  CONVNET)
    assert r.returncode == 2
    assert r.stderr.strip() == "distdebug: error: --overhead-block 1: give 2 steps or more per block"
    assert not (tmp_path / "run").exists()

"""Tier 3 (end to end): ``distdebug report RUN --html`` on real runs, opened in headless Chromium.

Each test checks what a person would: no console error, every plot drawn (marks counted by the
page itself), the planted fault visible where it happened (NaN marks and the first bad step, the
straggler's red bar, the slow link outlined, the hang and the killed ranks in the timeline), the
trace links pointing at real files. Screenshots are kept in ``test-artifacts/`` (or
``$DISTDEBUG_ARTIFACTS``) for a human to look at.

Chromium comes from Debian's package (``.ci/run`` installs it and sets DISTDEBUG_REQUIRE_BROWSER,
so that CI fails rather than skips when it is missing).

Needs: 2-3 ranks (a hang needs a culprit and a waiter; 1,000 ranks are synthetic records) and 28
steps for the straggler's red bar (8-step medians after the fault) and the NaN at step 24 after it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.browser import Browser, find_chromium
from tests.e2e.conftest import SHARED
from tests.helpers import DATA, RECIPES, ROOT, distdebug
from tests.synthetic import write_run

ARTIFACTS = Path(os.environ.get("DISTDEBUG_ARTIFACTS") or ROOT / "test-artifacts")


@pytest.fixture(scope="module")
def browser():
    exe = find_chromium()
    if exe is None:
        if os.environ.get("DISTDEBUG_REQUIRE_BROWSER"):
            pytest.fail("DISTDEBUG_REQUIRE_BROWSER is set but no chromium is installed (apt-get install chromium)")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    with Browser(exe) as b:
        yield b


def open_report(browser: Browser, run_dir: Path, out: Path, shot: str) -> dict:
    r = distdebug("report", str(run_dir), "--html", str(out), timeout=120)
    assert r.returncode == 0, r.output
    assert "Traceback" not in r.stderr
    browser.open(out)
    assert browser.console_errors() == []
    drawn = browser.evaluate("JSON.stringify(window.distdebugDrawn || null)")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    png = ARTIFACTS / f"{shot}.png"
    browser.screenshot(png)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(drawn)


def count(browser: Browser, selector: str) -> int:
    return browser.evaluate(f"document.querySelectorAll({selector!r}).length")


@pytest.mark.alone  # asserts on a measured time: nothing runs beside it
def test_report_of_a_run_with_a_nan_and_a_straggler(tmp_path, browser):
    run_dir = tmp_path / "run"
    r = distdebug("attach", "--run-dir", str(run_dir), "--profile-steps", "3:4",
                  "--inject", "nan_grad:rank=0,step=24", "--inject", "straggler:rank=1,step=2,delay=0.04",
                  str(RECIPES / "manual_allreduce.py"), "--steps", "28", timeout=240)
    assert r.returncode == 0, r.output
    drawn = open_report(browser, run_dir, tmp_path / "report" / "index.html", "report-nan-straggler")
    for plot in ("loss", "step_time", "timeline", "memory", "straggler"):
        assert drawn[plot] > 0, (plot, drawn)
    assert "sweep" not in drawn  # no doctor in this run: no empty bandwidth boxes
    # The NaN: x marks on the loss plot from step 24, the first bad step marked on loss and timeline.
    assert count(browser, "[data-plot=loss] .nonfinite") >= 2
    assert count(browser, "[data-plot=loss] .first-bad") == 1 and count(browser, "[data-plot=timeline] .first-bad") == 1
    banner = browser.evaluate("document.querySelector('.banner.bad').textContent")
    assert "First bad step: 24" in banner and "nan_origin" in banner
    # The straggler: rank 1's bar is red (under the 0.7 threshold), rank 0's is not.
    bars = browser.evaluate("[...document.querySelectorAll('[data-plot=straggler] rect.bar')]"
                            ".map(r => [r.textContent.split(':')[0], r.getAttribute('fill')])")
    assert dict(bars) == {"rank 0": "#0e9f6e", "rank 1": "#e02424"}
    # Findings with cause and fix; fault banners; trace links that resolve.
    text = browser.evaluate("document.body.innerText")
    assert "likely cause" in text and "Fault injected on purpose: nan_grad on rank 0 at step 24" in text
    hrefs = browser.evaluate("[...document.querySelectorAll('table.windows a')].map(a => a.getAttribute('href'))")
    assert len(hrefs) == 2
    for h in hrefs:
        assert not h.startswith("/") and (tmp_path / "report" / h).resolve().is_file()


@pytest.mark.xdist_group(SHARED)
def test_report_of_a_hung_run_and_of_the_doctor(tmp_path, browser, skipped_allreduce_run):
    # A hang: rank 1 skips a collective at step 3; the job is ended after the stall timeout (exit 124).
    # The run is test_hang's (the skipped_allreduce_run fixture), made once.
    hung, r = skipped_allreduce_run.run_dir, skipped_allreduce_run.result
    assert r.returncode == 124, r.output
    drawn = open_report(browser, hung, tmp_path / "hung.html", "report-hang")
    assert drawn["loss"] > 0 and drawn["step_time"] > 0 and drawn["timeline"] > 0
    events = browser.evaluate("[...document.querySelectorAll('[data-plot=timeline] .event')].map(e => e.textContent)")
    assert any(e.startswith("critical hang") for e in events), events
    assert any("rank 0 after step" in e for e in events) and any("rank 1 after step" in e for e in events)
    assert "exit code 124" in browser.evaluate("document.querySelector('header').textContent")

    # The doctor with a slowed pair among 3 ranks: sweep and link matrix drawn, the pair flagged.
    doc = tmp_path / "doctor"
    worker = ROOT / "distdebug" / "doctor" / "worker.py"
    r = distdebug("attach", "--run-dir", str(doc), "--nproc-per-node", "3", "--inject", "slow_link:a=0,b=2",
                  str(worker), "--bandwidth", "--max-bytes", "4096", timeout=240)
    assert r.returncode == 0, r.output
    drawn = open_report(browser, doc, tmp_path / "doctor.html", "report-doctor")
    assert drawn["sweep"] > 1 and drawn["links"] >= 9
    assert "loss" not in drawn and "memory" not in drawn  # the doctor trains nothing: no empty training plots
    text = browser.evaluate("document.body.innerText")
    assert re.search(r"link 0-2", text) and "link_matrix" in text and "Doctor checks" in text


def test_report_of_1000_ranks_stays_readable(tmp_path, browser):
    run_dir = write_run(tmp_path / "run", ranks=1000, steps=60, slow_rank=537, nan_rank=811, nan_step=50,
                        killed=(3, 999), killed_at=30)
    drawn = open_report(browser, run_dir, tmp_path / "big.html", "report-1000-ranks")
    for plot in ("loss", "step_time", "timeline", "memory", "straggler"):
        assert drawn[plot] > 0, (plot, drawn)
    # Aggregated: at most 128 heatmap rows, 64 bars; the page is not taller than a few screens.
    assert count(browser, "[data-plot=memory] rect.bar") <= 64 * 5
    assert count(browser, "[data-plot=straggler] rect.bar") <= 64
    assert browser.evaluate("document.body.scrollHeight") < 6000
    red = browser.evaluate("[...document.querySelectorAll('[data-plot=straggler] rect.bar')]"
                           ".filter(r => r.getAttribute('fill') == '#e02424').map(r => r.textContent)")
    assert len(red) == 1 and red[0].startswith("ranks 528-543")


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_out_of_memory_is_a_finding_with_its_phase_and_cause(tmp_path, phase):
    r = distdebug("attach", "--run-dir", str(tmp_path), str(DATA / "scripts" / "oom.py"), "--phase", phase,
                  timeout=120)
    assert r.returncode == 1, r.output
    rep = distdebug("report", str(tmp_path), "--json", timeout=60)
    assert rep.returncode == 0, rep.output
    [oom] = [f for f in json.loads(rep.stdout)["findings"] if f["detector"] == "oom"]
    assert (oom["ranks"], oom["step"], oom["subject"]) == ([1], 3, f"out of memory in {phase}")
    advice = oom["advice"]
    if phase == "forward":
        assert advice["symptom"] == "out of memory in forward, not backward" and "activations" in advice["cause"]
    else:
        assert "optimizer state" in advice["cause"] and "ZeRO" in advice["fix"]

"""Tier 1 (pure): the teardown verdict, a rank that died after completing the script vs a crash, on
synthetic run directories; and the release of destroyed groups held in function defaults."""

from __future__ import annotations

import json

from distdebug.analysis.teardown import summary_line, teardown_findings
from distdebug.artifacts import layout, schema
from distdebug.artifacts.reader import load_run
from tests.synthetic import write_run


def test_every_failed_rank_completed_its_script_gives_one_teardown_finding_each(tmp_path):
    run = load_run(write_run(tmp_path, ranks=4, steps=5))
    found = teardown_findings(run, {0: -15, 1: -6, 3: -6}, first=1)  # rank 0: the launcher's SIGTERM
    assert [(f.detector, f.ranks, f.step, f.subject) for f in found] == [
        ("teardown", [1], 5, "interpreter exit"), ("teardown", [3], 5, "interpreter exit")]
    assert found[0].message.startswith("rank 1 completed the script and aborted during interpreter exit (SIGABRT): "
                                       "results are complete; a known teardown race")
    assert summary_line(found).startswith("rank 1 completed the script and aborted during interpreter exit (SIGABRT)"
                                          " (and 1 more rank(s) the same way): results are complete")


def test_a_rank_without_an_end_record_makes_it_a_real_failure(tmp_path):
    run = load_run(write_run(tmp_path, ranks=4, steps=5, killed=(2,), killed_at=3))
    assert teardown_findings(run, {1: -6, 2: -9}) is None
    assert teardown_findings(run, {2: -6}) is None


def test_a_script_error_or_a_nonzero_exit_is_not_a_teardown(tmp_path):
    root = write_run(tmp_path, ranks=2, steps=3)
    path = layout.events_path(root, 1)
    lines = path.read_text().splitlines()
    err = schema.record(schema.SCRIPT_ERROR, rank=1, step=2, exception="ValueError", message="boom")
    path.write_text("\n".join([*lines[:-1], json.dumps(err), lines[-1].replace('"exit_code":0', '"exit_code":1')])
                    + "\n")
    assert teardown_findings(load_run(root), {1: 1}) is None


def test_what_was_alive_is_named_without_distdebugs_own_threads(tmp_path):
    root = write_run(tmp_path, ranks=2, steps=3)
    path = layout.events_path(root, 0)
    lines = path.read_text().splitlines()
    end = json.loads(lines[-1])
    end["alive"] = {"process_groups": 1, "native_threads": ["gloo_tcp_loop", "pt_gloo_runloop", "pt_gloo_runloop"],
                    "python_threads": ["distdebug-watchdog", "prefetcher"]}
    path.write_text("\n".join([*lines[:-1], json.dumps(end)]) + "\n")
    [f] = teardown_findings(load_run(root), {0: -6})
    assert ("Still alive when the script ended: 1 process group(s) not destroyed; threads gloo_tcp_loop, "
            "pt_gloo_runloop x2; Python threads prefetcher") in f.message


def test_a_rank_the_launcher_stopped_after_its_last_step_does_not_hide_a_teardown_abort(tmp_path):
    # Rank 1 finished and aborted at exit; the launcher SIGTERMed rank 0 before rank 0 wrote its end
    # record (seen in the suite on a loaded machine). Rank 0 had run all 5 steps and raised nothing.
    run = load_run(write_run(tmp_path, ranks=2, steps=5, killed=(0,), killed_at=5))
    (f,) = teardown_findings(run, {1: -6, 0: -15}, first=1)
    assert (f.ranks, f.step) == ([1], 5)
    assert "Rank(s) [0] were stopped by the launcher (SIGTERM) after their last step (5)" in f.message
    # Stopped before its last step, or killed by anything but the launcher's SIGTERM: a real failure.
    short = load_run(write_run(tmp_path / "short", ranks=2, steps=5, killed=(0,), killed_at=3))
    assert teardown_findings(short, {1: -6, 0: -15}, first=1) is None
    assert teardown_findings(run, {1: -6, 0: -9}, first=1) is None

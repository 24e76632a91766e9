"""Tier 3 (end to end): a rank's end, after the script, is clean under attach, and a rank that dies
in interpreter exit after completing the script is told apart from a crash.

The mechanism, checked against PyTorch first: a module imported after init_process_group whose
functions default to ``group=group.WORLD`` keeps the default group, and its gloo threads, alive past
destroy_process_group() (torch.distributed.nn.functional, imported by torch._dynamo at the first
optimizer step). Those threads meet interpreter teardown, where gloo sometimes aborts the process
(pytorch/pytorch#179291).

Needs: 2 ranks (a gloo group between them) and teardown.py's 3 steps: the subject is what happens after
the script's last step.
"""

from __future__ import annotations

import json

from tests.helpers import DATA, distdebug, torchrun

SCRIPT = str(DATA / "scripts" / "teardown.py")


def threads(out):
    return {p.name: p.read_text().split() for p in sorted(out.glob("rank*.txt"))}


def test_plain_torchrun_keeps_the_destroyed_default_group_alive_into_interpreter_exit(tmp_path):
    # The gloo threads are listed at the start of interpreter exit, then the rank leaves with
    # os._exit(0): this test shows what is alive, it does not run torch's teardown race (which
    # aborts now and then on a loaded machine, pytorch#179291) and call the outcome a result.
    r = torchrun(SCRIPT, "--threads-out", str(tmp_path), "--exit-after-listing")
    assert r.returncode == 0, r.output
    seen = threads(tmp_path)
    assert sorted(seen) == ["rank0.txt", "rank1.txt"]
    assert all("pt_gloo_runloop" in names for names in seen.values()), seen


def test_under_attach_no_gloo_thread_is_left_for_interpreter_exit(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path / "run"), SCRIPT, "--threads-out", str(tmp_path / "t"))
    assert r.returncode == 0, r.output
    seen = threads(tmp_path / "t")
    assert sorted(seen) == ["rank0.txt", "rank1.txt"]
    assert seen == {"rank0.txt": [], "rank1.txt": []}, seen
    ends = [json.loads(line) for line in (tmp_path / "run" / "rank-00000" / "events.jsonl").read_text().splitlines()
            if '"end"' in line]
    assert "torch.distributed.nn.functional.all_reduce" in ends[-1]["released_defaults"]


def test_an_abort_after_the_script_completed_is_not_called_a_training_failure(tmp_path):
    run = tmp_path / "run"
    r = distdebug("attach", "--run-dir", str(run), SCRIPT, "--abort-at-exit", "1")
    assert r.returncode == 134, r.output  # 128 + SIGABRT, as for any rank killed by a signal
    assert "rank 1: done" in r.stdout
    assert ("distdebug: rank 1 completed the script and aborted during interpreter exit (SIGABRT): "
            "results are complete") in r.stderr, r.stderr
    assert "training failed" not in r.stderr
    rep = distdebug("report", str(run), "--json")
    assert rep.returncode == 0, rep.output
    found = [(f["detector"], f["ranks"], f["step"], f["subject"]) for f in json.loads(rep.stdout)["findings"]]
    assert found == [("teardown", [1], 3, "interpreter exit")], found
    text = distdebug("report", str(run)).stdout
    assert "completed the script and aborted during interpreter exit (SIGABRT)" in " ".join(text.split())
    assert "destroy_process_group()" in text


def test_a_script_that_leaves_by_os_exit_still_gets_its_end_record(tmp_path):
    # The recipes end this way (recipes/_common.finish); the bootstrap sees os._exit and closes first.
    r = distdebug("attach", "--run-dir", str(tmp_path), SCRIPT, "--os-exit", "0")
    assert r.returncode == 0, r.output
    for rank in (0, 1):
        ends = [json.loads(line) for line in (tmp_path / f"rank-0000{rank}" / "events.jsonl").read_text().splitlines()
                if '"kind":"end"' in line]
        assert [(e["exit_code"], e["steps"]) for e in ends] == [(0, 3)]

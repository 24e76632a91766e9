"""Tier 3 (end to end): a stranger's input. Each bad input gives one line saying what is wrong and
what to do, and a non-zero exit; damage in a run directory is said; secrets never land in it.

Needs: no ranks for the bad inputs (the CLI refuses before any launch: seconds each); one short real
run (2 ranks, the script's default 5 steps) where a run directory is damaged or searched for secrets."""

from __future__ import annotations

import json

import pytest

from tests.helpers import DATA, distdebug, make_env
from tests.synthetic import write_run


@pytest.mark.smoke
@pytest.mark.parametrize("command", ["report", "diff", "stacks", "top"])
def test_a_directory_that_is_not_a_run_is_one_line_and_exit_1(command):
    r = distdebug(command, "/etc", timeout=60)
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr == ("distdebug: error: /etc is not a distdebug run directory (no manifest.json, no rank-NNNNN/ "
                        "folders): give the directory 'distdebug attach' printed\n")


@pytest.mark.parametrize("options, message", [
    (["--nproc-per-node", "abc"], "--nproc-per-node must be a positive number or one of gpu, cpu, auto, xpu; "
                                  "got 'abc'"),
    (["--nnodes", "2:1"], "--nnodes must be N or MIN:MAX with 0 < MIN <= MAX, got '2:1'"),
    (["--max-restarts", "-1"], "--max-restarts must be 0 or more"),
    (["--rdzv-endpoint", "hostonly"], "--rdzv-endpoint must be HOST:PORT, got 'hostonly'"),
    (["--stall-timeout", "-5"], "--stall-timeout must be 0 (off) or a number of seconds, got -5.0"),
])
def test_a_malformed_launcher_option_is_named_before_the_missing_script(tmp_path, options, message):
    r = distdebug("attach", *options, str(tmp_path / "missing.py"), timeout=60)
    assert r.returncode == 2, r.output
    assert r.stderr == f"distdebug: error: {message}\n"
    assert not (tmp_path / "distdebug-runs").exists()


def test_damage_in_a_run_directory_is_said_and_the_rest_still_shown(tmp_path):
    run = write_run(tmp_path / "run", ranks=2, steps=6, killed=(1,), killed_at=4)
    (run / "manifest.json").write_text('{"schema": "distdebug-run", "comm')  # cut by a full disk
    events = run / "rank-00001" / "events.jsonl"
    text = events.read_text()
    events.write_text(text.replace("\n", "\nnot json\n", 2))  # two garbled lines, plus the cut last one
    r = distdebug("report", str(run), timeout=60)
    assert r.returncode == 0, r.output
    assert r.stderr.splitlines() == [
        "distdebug: warning: manifest.json is unreadable: the command and launcher settings are missing below",
        "distdebug: warning: rank 1: 3 unreadable line(s) skipped in events.jsonl",
    ]
    assert "no end record" in r.stdout and "│    1 │" in r.stdout  # rank 1's readable steps are still there
    j = distdebug("report", str(run), "--json", timeout=60)
    assert json.loads(j.stdout)["warnings"][1] == "rank 1: 3 unreadable line(s) skipped in events.jsonl"


PLANTED = ["PlantedDbPass99", "plantedbearertoken0123456789", "sk-planted-key-12345", "planted-pw-6789",
           "hf_PlantedTokenValue42"]


def test_secrets_are_redacted_by_value_in_every_file_of_the_run_directory(tmp_path):
    env = make_env(DATABASE_URL="postgres://trainer:PlantedDbPass99@db.internal:5432/runs",
                   AUTH_HEADER="Authorization: Bearer plantedbearertoken0123456789",
                   HF_TOKEN="hf_PlantedTokenValue42")
    run = tmp_path / "run"
    r = distdebug("attach", "--run-dir", str(run), str(DATA / "scripts" / "planted_secrets.py"),
                  "--api-key", "sk-planted-key-12345", "--password=planted-pw-6789", env=env)
    assert r.returncode == 1, r.output
    files = [p for p in run.rglob("*") if p.is_file()]
    assert any(p.name == "events.jsonl" for p in files) and any(p.name == "manifest.json" for p in files)
    leaks = [(str(p.relative_to(run)), s) for p in files for s in PLANTED if s.encode() in p.read_bytes()]
    assert leaks == []
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["env"]["DATABASE_URL"] == "postgres://<redacted>@db.internal:5432/runs"
    assert manifest["env"]["HF_TOKEN"] == "<redacted>"
    assert manifest["target_args"] == ["--api-key", "<redacted>", "--password=<redacted>"]
    errors = [json.loads(line) for line in (run / "rank-00000" / "events.jsonl").read_text().splitlines()
              if '"script_error"' in line]
    assert errors and "upload failed: postgres://<redacted>@db.internal" in errors[0]["message"]


def test_an_init_process_group_argument_error_is_the_scripts_own_error(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path), str(DATA / "scripts" / "bad_init.py"))
    assert r.returncode == 1, r.output
    rep = json.loads(distdebug("report", str(tmp_path), "--json").stdout)
    found = [(f["detector"], f["subject"]) for f in rep["findings"]]
    assert found == [("startup", "init_process_group")], found
    # Both ranks raise; the launcher may end one before it records its error.
    assert rep["findings"][0]["ranks"] in ([0], [1], [0, 1])
    msg = rep["findings"][0]["message"]
    assert "ValueError: init_process_group device_id parameter must be an accelerator with an index" in msg
    assert "not a connection problem" in msg
    assert "could not form the process group" not in json.dumps(rep) and "MASTER_ADDR" not in json.dumps(rep)

"""Tier 3 (CLI end to end): doctor on this host, and attach explaining a bad variable before the
script's own error.

Needs: no ranks for the environment checks and lint (one process); 2 ranks for the bandwidth sweep
(the smallest link matrix) and for DeepSpeed's zero_grad trap, found at its step (2-4 steps)."""

from __future__ import annotations

import json
import socket

import pytest

from distdebug.artifacts import layout
from distdebug.artifacts.reader import read_events
from tests.helpers import DATA, RECIPES, distdebug, make_env


@pytest.mark.smoke
def test_doctor_fails_a_missing_socket_interface_and_passes_without_it():
    r = distdebug("doctor", "--json", env=make_env(GLOO_SOCKET_IFNAME="distdebug_missing0"))
    assert r.returncode == 1, r.output
    checks = {c["name"]: c for c in json.loads(r.stdout)["ranks"]["local"]["checks"]}
    assert checks["GLOO_SOCKET_IFNAME"]["status"] == "fail"
    assert "distdebug_missing0 names no interface of this host" in checks["GLOO_SOCKET_IFNAME"]["detail"]
    assert checks["versions"]["status"] == "pass" and "torch 2." in checks["versions"]["detail"]
    r = distdebug("doctor", env=make_env(GLOO_SOCKET_IFNAME="lo"))
    assert r.returncode == 0, r.output
    assert "GLOO_SOCKET_IFNAME" in r.stdout and "fail" not in r.stdout


def test_attach_explains_a_missing_socket_interface_before_the_raw_error(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path), str(RECIPES / "manual_allreduce.py"), "--steps", "2",
                  env=make_env(GLOO_SOCKET_IFNAME="distdebug_missing0"), timeout=120)
    assert r.returncode != 0
    # Said by the node's launcher before any rank started: never raced by a rank that fails at once (torch's
    # agent then stops the others, once before a local rank 0 still importing torch could say it).
    said = r.stderr.index(f"distdebug[host {socket.gethostname()}] ERROR env_check: GLOO_SOCKET_IFNAME: "
                          "GLOO_SOCKET_IFNAME=distdebug_missing0 names no interface")
    assert said < r.stderr.index("Traceback") and "distdebug:   fix: set GLOO_SOCKET_IFNAME to one of" in r.stderr
    assert [x for x in read_events(layout.events_path(tmp_path, 0))[0] if x["kind"] == "finding"] == []  # said once
    rep = json.loads(distdebug("report", str(tmp_path), "--json").stdout)
    (f,) = [x for x in rep["findings"] if x["detector"] == "env_check"]  # filed once, under the node's local rank 0
    assert (f["severity"], f["subject"], f["ranks"]) == ("error", "GLOO_SOCKET_IFNAME", [0])
    assert f["evidence"]["host"] == socket.gethostname() and f"(host {socket.gethostname()})" in f["message"]
    assert "findings" not in json.loads(layout.node_path(tmp_path, 0).read_text())  # filed: one place each
    assert f["fix"].startswith("set GLOO_SOCKET_IFNAME to one of")
    # The job-level verdict: the process group never formed (not a hang in some collective).
    [h] = [x for x in rep["findings"] if x["detector"] == "hang"]
    # Both ranks raise there; the launcher may end one before it records it (then the message says so).
    assert (h["subject"], h["step"]) == ("init_process_group", None) and h["ranks"] and set(h["ranks"]) <= {0, 1}
    assert len(h["ranks"]) == 2 or "still in init_process_group when the job ended" in h["message"] \
        or "left no record of reaching it (ended by the launcher)" in h["message"]
    assert "Unable to find address for: distdebug_missing0" in h["message"]
    assert h["advice"]["symptom"] == "job fails to start, or runs slow, on some nodes only"


@pytest.mark.smoke
def test_bandwidth_sweep_and_link_matrix_on_two_gloo_ranks(tmp_path):
    r = distdebug("doctor", "--bandwidth", "--nproc-per-node", "2", "--max-bytes", "65536", "--run-dir",
                  str(tmp_path), "--json", timeout=180)
    assert r.returncode == 0, r.output
    d = json.loads(r.stdout)
    assert d["backend"] == "gloo" and d["world_size"] == 2 and d["differences"] == []
    sweep = d["all_reduce"]
    assert [row["bytes"] for row in sweep] == [8 << i for i in range(14)]  # 8 B to 64 KiB, doubling
    for row in sweep:
        assert row["time_us"] > 0
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (2 - 1) / 2)
    assert list(d["links"]["bandwidth_GBps"]) == ["0-1"] and d["links"]["bandwidth_GBps"]["0-1"] > 0
    assert d["links"]["latency_us"]["0-1"] > 0
    assert sorted(d["ranks"]) == ["0", "1"] and all(r["checks"] for r in d["ranks"].values())
    assert (tmp_path / "doctor.json").is_file()
    text = distdebug("doctor", "--bandwidth", "--nproc-per-node", "2", "--max-bytes", "1024", "--run-dir",
                     str(tmp_path / "again"), timeout=180)
    assert text.returncode == 0 and "all_reduce bus bandwidth (gloo, 2 ranks)" in text.stdout
    assert "link matrix" in text.stdout


@pytest.mark.smoke
def test_lint_cli_points_at_file_and_line_and_fails_on_errors(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
                      "model = DDP(net, gradient_as_bucket_view=True, find_unused_parameters=True)\n"
                      "for p in model.parameters():\n    p.grad.detach_()\n")
    r = distdebug("lint", str(script))
    assert r.returncode == 1, r.output  # an error among the findings
    assert f"{script}:3: warning [ddp-find-unused-parameters]" in r.stdout
    assert f"{script}:5: error [ddp-bucket-view-detach]" in r.stdout and "    fix: " in r.stdout
    r = distdebug("lint", "--json", str(RECIPES / "ddp_convnet.py"))
    assert r.returncode == 0 and json.loads(r.stdout) == []


def test_deepspeed_zero_grad_between_backward_and_step_is_caught_at_runtime(tmp_path):
    script = str(DATA / "scripts" / "ds_zero_grad.py")
    r = distdebug("attach", "--run-dir", str(tmp_path / "bug"), script, "--steps", "4", "--zero-grad-at", "3")
    assert r.returncode == 0, r.output
    for rank in (0, 1):
        (f,) = [x for x in read_events(layout.events_path(tmp_path / "bug", rank))[0]
                if x["kind"] == "finding" and x["detector"] == "config_lint"]
        assert (f["severity"], f["step"], f["subject"]) == ("error", 3, "engine.zero_grad")
    # its clean twin (zero_grad after step() is only redundant: no finding), the same script without
    # --zero-grad-at: test_config_errors's test_deepspeed_settings_and_saves_read_from_the_live_engine ("ok")


def test_lint_reads_a_module_level_deepspeed_loop():
    r = distdebug("lint", "--json", str(DATA / "scripts" / "ds_zero_grad.py"))
    assert r.returncode == 1
    assert [(f["rule"], f["line"]) for f in json.loads(r.stdout)] == [
        ("deepspeed-zero-grad-before-step", 47), ("deepspeed-zero-grad-redundant", 49),
        ("deepspeed-torch-save", 51)]

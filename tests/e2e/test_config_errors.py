"""Tier 3 (end to end): configuration traps that PyTorch and DeepSpeed reveal only by raising, turned
into findings with rank, step, subject and fix (the runtime half of ``distdebug lint`` for them).

Real ranks, real DDP and DeepSpeed errors: the scripts in tests/data/scripts make each mistake.

Needs: 2 ranks (DDP and ZeRO raise these only with a real process group) and the fewest steps that
reach each error: a DDP trap raises at the step that reveals it (2-3), DeepSpeed's settings are read at
engine start (2 steps).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import DATA, distdebug

PITFALLS = str(DATA / "scripts" / "ddp_pitfalls.py")


def findings(run_dir):
    r = distdebug("report", str(run_dir), "--json", timeout=60)
    assert r.returncode == 0, r.output
    return json.loads(r.stdout)["findings"]


@pytest.mark.parametrize("mode, step, subject, words", [
    ("unused", 2, "find_unused_parameters", "extra.weight, extra.bias"),
    ("static", 3, "static_graph", "graph changed between iterations"),
    ("detach", 2, "gradient_as_bucket_view", "detach_()"),
    ("device_ids", 1, "device_ids", "but got device_ids [0]"),
])
def test_ddp_trap_is_named_with_its_step(tmp_path, mode, step, subject, words):
    r = distdebug("attach", "--run-dir", str(tmp_path), PITFALLS, "--mode", mode, timeout=120)
    assert r.returncode == 1, r.output
    got = [f for f in findings(tmp_path) if f["detector"] == "config_lint" and f["severity"] == "error"]
    assert got, findings(tmp_path)
    assert {f["subject"] for f in got} == {subject}
    assert all(f["step"] == step for f in got) and sorted({r for f in got for r in f["ranks"]}) == [0, 1]
    assert words in got[0]["message"] and got[0]["fix"]


def test_output_device_that_ddp_ignores_is_named_from_the_call(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path), PITFALLS, "--mode", "output_device", timeout=120)
    assert r.returncode == 0, r.output
    [f] = findings(tmp_path)
    assert (f["detector"], f["severity"], f["subject"], f["step"], f["ranks"]) == \
        ("config_lint", "warning", "output_device", 1, [0, 1])
    assert "without device_ids: DDP ignores it" in f["message"]


def test_clean_twin_has_no_finding(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path), PITFALLS, "--mode", "clean", timeout=120)
    assert r.returncode == 0, r.output
    assert findings(tmp_path) == []


def test_deepspeed_batch_arithmetic(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path), str(DATA / "scripts" / "ds_zero_grad.py"),
                  "--train-batch-size", "12", timeout=180)
    assert r.returncode == 1, r.output
    [f] = [f for f in findings(tmp_path) if f["subject"] == "train_batch_size"]
    assert f["ranks"] == [0, 1] and f["step"] == 1 and f["detector"] == "config_lint"
    assert "train_batch_size 12 != micro batch 4 x accumulation 1 x world size 2 = 8" in f["message"]


DS = str(DATA / "scripts" / "ds_zero_grad.py")


def lint_findings(run_dir):
    return sorted((f["severity"], f["subject"], f["step"], tuple(f["ranks"])) for f in findings(run_dir)
                  if f["detector"] == "config_lint")


def fp16_on_this_cpu() -> bool:
    """DeepSpeed refuses fp16 ("Type fp16 is not supported on your device") on CPUs without oneDNN fp16."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def test_deepspeed_settings_and_saves_read_from_the_live_engine(tmp_path):
    # torch.save of the engine's model state after step 2 (no fp16: runs on every CPU).
    r = distdebug("attach", "--run-dir", str(tmp_path / "bad"), DS, "--torch-save", str(tmp_path / "model.pt"),
                  timeout=180)
    assert r.returncode == 0, r.output
    assert lint_findings(tmp_path / "bad") == [("warning", "torch.save of engine state", 2, (0, 1))]
    # ZeRO-3 offload_param with activation checkpointing in the config.
    r = distdebug("attach", "--run-dir", str(tmp_path / "offload"), DS, "--offload-param", "--steps", "2",
                  timeout=180)
    assert r.returncode == 0, r.output
    assert lint_findings(tmp_path / "offload") == [("warning", "offload_param with activation checkpointing", 1,
                                                    (0, 1))]
    # The clean twin: save_checkpoint (which itself calls torch.save).
    r = distdebug("attach", "--run-dir", str(tmp_path / "ok"), DS, "--save-checkpoint", str(tmp_path / "ckpt"),
                  timeout=180)
    assert r.returncode == 0, r.output
    assert findings(tmp_path / "ok") == []


def test_deepspeed_fp16_static_loss_scale_read_from_the_live_engine(tmp_path):
    # The rule itself is proven on every machine in tests/unit/test_config_lint_rules.py; this is the
    # live engine, which needs fp16 on the CPU.
    if not fp16_on_this_cpu():
        pytest.skip("this CPU has no fp16 for DeepSpeed (torch.ops.mkldnn._is_mkldnn_fp16_supported() is False): "
                    "a live fp16 engine cannot be built here")
    r = distdebug("attach", "--run-dir", str(tmp_path / "bad"), DS, "--fp16-loss-scale", "128", timeout=180)
    assert r.returncode == 0, r.output
    assert lint_findings(tmp_path / "bad") == [("warning", "fp16 static loss scale", 1, (0, 1))]
    # its clean twin, the dynamic scale (--fp16-loss-scale 0), has no warning: test_amp's
    # test_deepspeed_fp16_dynamic_loss_scale_is_followed

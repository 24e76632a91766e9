"""Tier 3 (CLI): AMP loss scaling (torch.amp.GradScaler with fp16 autocast on CPU, as on a GPU).

A step the scaler skips for overflow is an info record, not a NaN; the recorded loss is the loss
the script computed (not the scaled one); loss_spike is not fooled; a scale that keeps collapsing is
a warning naming the steps; a real NaN is still found on its rank; --stop-on-nan lets a run whose
scaler handled its overflows finish; the training is bitwise the one torchrun runs.

Needs: 2 ranks (the NaN test plants its NaN on rank 1 and checks rank 0 is not blamed); 8-12 steps: the
scaler skips step 1 (its initial scale is too high for fp16) and the overflow planted at step 6, with
steps after each to see the scale halve and grow back; the collapsing-scale warning needs several skips
in a row; the real NaN is planted at step 7 of 10 with steps after it.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_attach import kinds
from tests.helpers import DATA, distdebug, read_digests, torchrun

SCRIPT = str(DATA / "scripts" / "amp_train.py")


def findings(run_dir, rank):
    return [(f["severity"], f["detector"], f["step"], f["subject"]) for f in kinds(run_dir, rank, "finding")]


def test_overflows_the_scaler_handles_are_info_not_nan_and_training_is_untouched(tmp_path):
    args = ["--steps", "12", "--overflow-at", "6"]
    ref = torchrun(SCRIPT, *args, "--digest-out", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr
    r = distdebug("attach", "--stop-on-nan", "--run-dir", str(tmp_path / "run"), SCRIPT, *args,
                  "--digest-out", str(tmp_path / "attached"), "--losses-out", str(tmp_path / "losses"))
    assert r.returncode == 0, r.output  # --stop-on-nan: the scaler handled every overflow
    assert read_digests(tmp_path / "attached") == read_digests(tmp_path / "ref")
    for rank in (0, 1):
        steps = kinds(tmp_path / "run", rank, "step")
        skipped = [s["step"] for s in steps if s.get("skipped")]
        # Step 1 (the initial scale 2^16 is too high for fp16, as on a GPU) and the planted step 6.
        assert 1 in skipped and 6 in skipped and len(skipped) <= 4, skipped
        assert findings(tmp_path / "run", rank) == [("info", "loss_scale", s, "skipped step") for s in skipped]
        # The loss recorded is the one the script computed, not the scaled one.
        script_losses = [float(v) for v in (tmp_path / "losses" / f"rank{rank}.txt").read_text().split()]
        assert [s["loss"] for s in steps] == script_losses
        scales = [s["loss_scale"] for s in steps]
        assert scales[0] == 65536.0 and scales[1] == 32768.0  # halved after the skipped step 1
        first = next(f for f in kinds(tmp_path / "run", rank, "finding") if f["step"] == 1)
        assert first["message"].startswith("scaler skipped step 1: scale 65536 -> 32768")


def test_a_real_nan_under_amp_is_still_found_on_its_rank(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path), SCRIPT, "--steps", "10", "--nan-at", "7", "--nan-rank", "1")
    assert r.returncode == 0, r.output
    errors = {rank: [f for f in findings(tmp_path, rank) if f[0] == "error"] for rank in (0, 1)}
    assert errors[0] == []
    assert sorted((d, step) for _, d, step, _ in errors[1]) == [("loss_nonfinite", 7), ("nan_origin", 7)], errors
    (origin,) = [f for f in kinds(tmp_path, 1, "finding") if f["detector"] == "nan_origin"]
    # born in the forward, in its input batch: the model's input is named;
    # the first local gradient in backward order (the last layer's) is in the message
    assert origin["ranks"] == [1] and origin["subject"] == "(input of Sequential)", origin
    assert "non-finite local gradient (before all-reduce): 2.bias" in origin["message"]
    assert origin["message"].startswith("NaN/Inf started on rank 1 at step 7")
    assert origin["evidence"]["first_nonfinite_module_output"] == "(input of Sequential)"


def test_a_scale_that_keeps_collapsing_is_a_warning_naming_the_steps(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path), SCRIPT, "--steps", "12", "--overflow-from", "4")
    assert r.returncode == 0, r.output
    for rank in (0, 1):
        warnings = [f for f in kinds(tmp_path, rank, "finding") if f["severity"] == "warning"]
        assert [(f["detector"], f["step"], f["subject"]) for f in warnings] == [("loss_scale", 4, "loss scale")]
        assert warnings[0]["evidence"]["skipped_steps"] == [4, 5, 6, 7, 8]
        assert not [f for f in findings(tmp_path, rank) if f[1] in ("nan_origin", "loss_spike")]


def test_deepspeed_fp16_dynamic_loss_scale_is_followed(tmp_path):
    # DeepSpeed's own scaler: its optimizer's host values (overflow, cur_scale). Needs fp16 on the CPU.
    import pytest

    from tests.e2e.test_config_errors import DS, fp16_on_this_cpu

    if not fp16_on_this_cpu():
        pytest.skip("this CPU has no fp16 for DeepSpeed (torch.ops.mkldnn._is_mkldnn_fp16_supported() is False): "
                    "a live fp16 engine cannot be built here")
    r = distdebug("attach", "--run-dir", str(tmp_path), DS, "--fp16-loss-scale", "0", "--steps", "8", timeout=240)
    assert r.returncode == 0, r.output
    for rank in (0, 1):
        steps = kinds(tmp_path, rank, "step")
        assert all(s.get("loss_scale") for s in steps), steps  # dynamic: 2^16 at the start
        skipped = [s["step"] for s in steps if s.get("skipped")]
        assert [f for f in findings(tmp_path, rank) if f[0] != "info"] == []
        assert sorted(f[2] for f in findings(tmp_path, rank) if f[1] == "loss_scale") == skipped


@pytest.mark.parametrize("wrap,nproc", [("manual", 2), ("none", 1)])
def test_a_plain_model_is_judged_as_ddp_is_and_the_scales_calibration_is_no_warning(wrap, nproc, tmp_path):
    """A plain nn.Sequential (not wrapped in DDP) with a hand-written all-reduce of its gradients, or alone
    in one process, under fp16 autocast and a GradScaler whose initial scale is 2^24: its first seven
    steps are skipped while the scale calibrates (PyTorch's words; Megatron starts at 2^32), then an
    overflow is planted at step 14 (a step its clean twin does not skip). Every skip is an info record,
    no warning, no NaN, --stop-on-nan lets it finish: the same as under DDP. Its clean twin (no overflow
    planted) has the calibration's infos only. And a real NaN in one rank's batch is still an error on
    that rank alone."""
    base = ["--steps", "16", "--wrap", wrap, "--init-scale", str(2.0 ** 24)]
    for name, extra in (("clean", []), ("overflow", ["--overflow-at", "14"])):
        run = tmp_path / name
        r = distdebug("attach", "--nproc-per-node", str(nproc), "--stop-on-nan", "--run-dir", str(run), SCRIPT,
                      *base, *extra)
        assert r.returncode == 0, r.output
        for rank in range(nproc):
            skipped = [s["step"] for s in kinds(run, rank, "step") if s.get("skipped")]
            assert skipped[:7] == list(range(1, 8)), skipped  # 2^24 -> 2^17: the calibration
            assert (14 in skipped) == (name == "overflow"), skipped
            assert findings(run, rank) == [("info", "loss_scale", s, "skipped step") for s in skipped]
    if wrap == "manual":
        r = distdebug("attach", "--run-dir", str(tmp_path / "nan"), SCRIPT, *base, "--nan-at", "12", "--nan-rank", "1")
        assert r.returncode == 0, r.output
        errors = {rank: [f for f in findings(tmp_path / "nan", rank) if f[0] == "error"] for rank in (0, 1)}
        assert errors[0] == []
        assert sorted((d, step, s) for _, d, step, s in errors[1]) == [
            ("loss_nonfinite", 12, "loss"), ("nan_origin", 12, "(input of Sequential)")], errors

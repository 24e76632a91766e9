"""Tier 3 (CLI): real configurations. A resume with torch.distributed.checkpoint's state-dict helpers
(which step the optimizer once themselves), the origin rank of a NaN when FSDP2 reduces the gradients (the
resumed run's; under ZeRO-2, where DeepSpeed skips the non-finite step itself: the catalogue's
nan_activation-zero2 cell in test_faults), and a run in which discovery found no model (said, never a quiet
"No findings.").

Needs: 2 ranks (3 where DDP's reduction paths must agree bit for bit on more than a pair); 3-6 steps:
a resume at step 3, a NaN at step 3-4 with a step after it."""

from __future__ import annotations

import re

import pytest

from tests.e2e.test_attach import kinds
from tests.helpers import DATA, distdebug, read_digests, torchrun

DCP = str(DATA / "scripts" / "dcp_resume.py")


def nan_findings(run_dir, rank):
    return [(f["severity"], f["step"], f["subject"]) for f in kinds(run_dir, rank, "finding")
            if f["detector"] == "nan_origin" and f["severity"] != "info"]


def test_a_dcp_resume_is_discovered_and_counted_like_the_scripts_steps(tmp_path):
    ck = str(tmp_path / "ck")
    r = torchrun(DCP, "--steps", "3", "--save", ck)
    assert r.returncode == 0, r.stderr
    r = distdebug("attach", "--run-dir", str(tmp_path / "run"), DCP, "--steps", "6", "--resume", ck,
                  "--nan-at", "4", "--nan-rank", "1")
    assert r.returncode == 0, r.output
    for rank in (0, 1):
        steps = [s["step"] for s in kinds(tmp_path / "run", rank, "step")]
        assert steps == [1, 2, 3, 4, 5, 6]  # set_state_dict's own optimizer.step() is not one of them
        (disc,) = kinds(tmp_path / "run", rank, "discovery")
        assert [m["class"] for m in disc["models"]] == ["Sequential"] and disc["step"] == 1
        assert not [f for f in kinds(tmp_path / "run", rank, "finding") if f["detector"] == "harness"]
    # ... and the detectors see it: the NaN planted in rank 1's batch at step 4 is found there.
    assert nan_findings(tmp_path / "run", 1) == [("error", 4, "0")]
    assert nan_findings(tmp_path / "run", 0) == [("warning", 4, "gradients")]  # it received it


def test_a_run_without_a_model_says_which_checks_saw_nothing(tmp_path):
    script = tmp_path / "no_model.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "w = torch.nn.Parameter(torch.ones(3))\n"
        "opt = torch.optim.SGD([w], lr=0.1)\n"
        "for _ in range(3):\n"
        "    (w * 2).sum().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "dist.destroy_process_group()\n")
    r = distdebug("attach", "--run-dir", str(tmp_path / "run"), str(script))
    assert r.returncode == 0, r.output
    for rank in (0, 1):
        (f,) = [f for f in kinds(tmp_path / "run", rank, "finding") if f["detector"] == "harness"]
        assert (f["severity"], f["subject"], f["step"]) == ("warning", "discovery", 1)
        assert "no model was found in step 1" in f["message"] and "nan_origin" in f["message"]


DDP_PATHS = str(DATA / "scripts" / "ddp_paths.py")


@pytest.mark.alone  # more ranks than cores, judged clean (no straggler): nothing runs beside it
def test_ddp_reduction_paths_stay_bitwise_identical_on_three_ranks(tmp_path):
    """Needs: 3 ranks: 1/3 is inexact, so any change to DDP's reduction (a multiplication by 1/world where
    DDP divides in place) shows in the last bit; 5 steps, the late hooks registered at step 3. The five
    modes run in turn in one launch (each a fresh model, wrapper and optimizer): under attach the later
    ones are new training phases, which must stay bitwise too."""
    ref = run_3(["torchrun"], ",".join(MODES), tmp_path / "ref")
    att = run_3(["attach", "--run-dir", str(tmp_path / "run")], ",".join(MODES), tmp_path / "attached")
    for mode in MODES:
        assert len(read_digests(tmp_path / "ref" / mode)) == 3, mode
        assert read_digests(tmp_path / "attached" / mode) == read_digests(tmp_path / "ref" / mode), mode
        if mode.startswith("hook"):  # the script's own hook ran, every bucket, as under torchrun
            calls = [sorted(re.findall(rf"rank (\d): mode {mode} hook calls (\d+)", out)) for out in (ref, att)]
            assert len(calls[0]) == 3 and int(calls[0][0][1]) > 0 and calls[0] == calls[1], calls


MODES = ("bucket_view", "no_sync", "hook_early", "hook_late", "builtin_late")


def run_3(how, mode, out):
    from tests.helpers import run

    argv = ["--nproc-per-node", "3"] + (how[1:] if how[0] == "attach" else []) + [
        DDP_PATHS, "--mode", mode, "--steps", "5", "--digest-out", str(out)]
    if how[0] == "torchrun":
        import sys

        r = run([sys.executable, "-m", "torch.distributed.run", *argv], timeout=240)
    else:
        r = distdebug("attach", *argv, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout

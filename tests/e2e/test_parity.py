"""Tier 3 (CLI): ``distdebug parity`` on real runs (issue 50, its first slice): the same script at 1 rank (the
reference), again at 1 rank as its twin (the last bit of every parameter perturbed each step: the band of benign
rounding), and at 2 ranks under DDP and under FSDP2: equivalent (the other layouts: test_parity_recipes.py); the same 2
ranks with the loss not divided by the world size (its gradients summed, not averaged): departs at step 1, at the first
gradient, with that cause named; a pair under autocast to bfloat16, equivalent, and against float32 runs departs with
the precision named.

Needs: 13 launches of a tiny MLP (1, 1, 2; 2, 2, 2, 1, 1, 2, 1, 1, 2 ranks side by side; one that fails), 10 steps each:
one without --parity, to show that recording changes no result; six under autocast to bfloat16. The faults' replay:
10 more.
"""

from __future__ import annotations

import json
import re

from tests.helpers import RECIPES, distdebug, side_by_side

SCRIPT = str(RECIPES / "parity_mlp.py")


def test_two_ranks_compute_what_one_rank_computes_and_summed_gradients_and_another_precision_depart(tmp_path):
    """The pair made by parity from two launch lines: equivalent, with stage 2 side by side. Then, side by side (their
    numbers are judged, not their times): the gradients summed (departs at step 1, with its HTML page), FSDP2's shards
    against the plain reference (equivalent), the candidate without --parity (bit for bit the recorded one), and a pair
    under autocast to bfloat16, whose twin perturbs the last bfloat16 bit (parameters and each backward's gradients): 2
    ranks against 1, both in bfloat16, equivalent, and so under FSDP2 (whose sharded gradients the twin rounds before
    the optimizer's step); the same candidate against the float32 reference and twin: departs at step 1 with the
    precision named. 13 launches."""
    # the reference, its twin and the candidate made by parity itself, from two launch lines
    ok = distdebug("parity", "--work-dir", str(tmp_path), "--launch-ref", f"--nproc-per-node 1 {SCRIPT}",
                   "--launch-cand", f"--nproc-per-node 2 {SCRIPT}", timeout=400)
    assert ok.returncode == 0, ok.output[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cand", "ref", "twin"]
    runs = {"summed": ("record", "2", ["--sum-grads"]), "fsdp2": ("record", "2", ["--fsdp2"]),
            "bare": (None, "2", []), "bf16": ("record", "1", ["--bf16"]),
            "bf16-twin": ("twin", "1", ["--bf16"]), "bf16-cand": ("record", "2", ["--bf16"]),
            # FSDP2 under autocast at the seed whose clean pair departed at step 1 (observed/bound 194) while the
            # twin's rounding missed FSDP2's sharded gradients, which no parameter hook sees
            **{name: (mode, nproc, ["--bf16", "--fsdp2", "--seed", "4"]) for name, mode, nproc in (
                ("bf16-fsdp2-ref", "record", "1"), ("bf16-fsdp2-twin", "twin", "1"), ("bf16-fsdp2", "record", "2"))}}
    for r in side_by_side(*[["attach", "--run-dir", str(tmp_path / name), *(["--parity", mode] if mode else []),
                             "--nproc-per-node", nproc, SCRIPT, *extra] for name, (mode, nproc, extra) in runs.items()],
                          timeout=400):
        assert r.returncode == 0, r.output[-3000:]
    assert ("parity of 2 rank(s) against 1: the loss and gradient norm at every step, the tensors at 8 recorded "
            "steps (1-8): equivalent (largest observed/bound") in ok.stdout, ok.stdout
    # stage 2, side by side: each size's step time and peak memory, and the scaling efficiency
    assert "step time: 1 rank(s) " in ok.stdout and "scaling efficiency " in ok.stdout, ok.stdout
    # the runs parity makes profile steps 4-5: the communication share per size (2 ranks all-reduce: above 0)
    shares = re.findall(r"communication (\d+)% of the step", ok.stdout)
    assert len(shares) == 2 and int(shares[1]) > 0, ok.stdout
    got = json.loads(distdebug("parity", "--json", str(tmp_path / "ref"), str(tmp_path / "cand"), "--twin",
                               str(tmp_path / "twin")).stdout)
    assert got["equivalent"] and got["largest"]["observed"] <= got["largest"]["bound"]
    assert got["compared"] == 2 * 10 + 8 * 2 * 4  # loss and gradient norm at 10 steps; 4 gradients, 4 parameters
    # DDP against FSDP2: FSDP2's shards, each sketched at its global place by its rank, compared with the reference's
    # whole (plain) tensors: equivalent
    r = distdebug("parity", str(tmp_path / "ref"), str(tmp_path / "fsdp2"), "--twin", str(tmp_path / "twin"))
    assert r.returncode == 0 and ": equivalent (largest observed/bound" in r.stdout, r.output
    # the twin is a real band: it departed from the reference (its perturbation acted), by rounding's size only
    twin_vs_ref = distdebug("diff", str(tmp_path / "ref"), str(tmp_path / "twin"))
    assert twin_vs_ref.returncode == 1, twin_vs_ref.output
    # recording changes nothing: the candidate's every tensor at every step is bit for bit a run's without it
    same = distdebug("diff", str(tmp_path / "cand"), str(tmp_path / "bare"))
    assert same.returncode == 0, same.output
    bad = distdebug("parity", str(tmp_path / "ref"), str(tmp_path / "summed"), "--twin", str(tmp_path / "twin"),
                    "--html", str(tmp_path / "parity.html"))
    assert bad.returncode == 1, bad.output
    page = (tmp_path / "parity.html").read_text()  # the page: the verdict, its cause, both losses and the band
    assert "departs</span>" in page and "<b>gradient_scale</b> (step 1)" in page and page.count("<svg") == 2
    assert "departs at step 1: first grad:0.weight at observed/bound" in bad.stdout, bad.stdout
    assert "likely cause: every gradient is 2x the reference's (2 ranks against 1): summed over the ranks" \
        in bad.stdout, bad.stdout
    # what cannot be compared is said in one line, exit 2: the twin given as the candidate, a path that is no run,
    # a run without records, a launch that fails
    r = distdebug("parity", str(tmp_path / "ref"), str(tmp_path / "twin"), "--twin", str(tmp_path / "twin"))
    assert r.returncode == 2 and "its results differ on purpose" in r.stderr and "Traceback" not in r.stderr
    r = distdebug("parity", str(tmp_path / "ref"), str(tmp_path / "missing"), "--twin", str(tmp_path / "twin"))
    assert r.returncode == 2 and "no run directory" in r.stderr and "Traceback" not in r.stderr
    r = distdebug("parity", str(tmp_path / "ref"), str(tmp_path / "bare"), "--twin", str(tmp_path / "twin"))
    assert r.returncode == 2 and "no parity records: run it with distdebug attach --parity" in r.stderr
    r = distdebug("parity", "--work-dir", str(tmp_path / "failed"), "--launch-ref", "--nproc-per-node 1 missing.py",
                  "--launch-cand", f"--nproc-per-node 2 {SCRIPT}")
    assert r.returncode == 2 and "parity: cannot compare: the ref run exited" in r.stderr, r.output[-2000:]
    # bfloat16 against bfloat16, under DDP and under FSDP2: equivalent; against float32: the precision named
    for ref, cand, twin in (("bf16", "bf16-cand", "bf16-twin"), ("bf16-fsdp2-ref", "bf16-fsdp2", "bf16-fsdp2-twin")):
        ok = distdebug("parity", "--json", str(tmp_path / ref), str(tmp_path / cand), "--twin", str(tmp_path / twin))
        got = json.loads(ok.stdout)
        assert ok.returncode == 0 and got["equivalent"] and got["causes"] == [], ok.output
    mixed = json.loads(distdebug("parity", "--json", str(tmp_path / "ref"), str(tmp_path / "bf16-cand"), "--twin",
                                 str(tmp_path / "twin")).stdout)
    assert not mixed["equivalent"] and mixed["first"]["step"] == 1
    assert [c["kind"] for c in mixed["causes"]] == ["dtype"] and "computes in bfloat16 (autocast)" in mixed["cause"]


def test_each_parity_fault_departs_at_its_step_and_tensor_with_its_class_named(tmp_path):
    """faults replay --recipe parity: the recipe at 1 rank and its twin, once; the clean candidate at 2 ranks
    (equivalent: the clean twin of every fault) and each fault's candidate, which parity must find departing at
    the step the fault acted in, at the tensor it names first, with the fault's class first among the causes.
    10 launches (1, 1 and eight of 2 ranks), 10 steps each (duplicate_data's 20: each rank reads every sample)."""
    import xml.etree.ElementTree as ET

    junit = tmp_path / "faults.xml"
    r = distdebug("faults", "replay", "-j", "2", "--recipe", "parity", "--work-dir", str(tmp_path / "runs"), "--junit",
                  str(junit), timeout=1500)
    assert r.returncode == 0, r.output[-4000:]
    assert "7 applicable, 7 caught-localised, 0 not applicable; 1 of 1 clean runs clean; 0 failed" in r.stdout
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert set(cases) == {"clean", "grad_summed", "lr_scaled", "unreduced_grad", "local_clip", "low_dtype_state",
                          "rank_dropout", "duplicate_data"}
    outs = {n: c.find("system-out").text for n, c in cases.items()}
    assert all(c.find("failure") is None for c in cases.values()), outs
    expected = {  # the step each acts in (3 by default; the sampler's from the first), the tensor, the class
        "grad_summed": "parity departs at step 3 at grad:0.weight, likely cause gradient_scale",
        "lr_scaled": "parity departs at step 3 at param:0.weight, likely cause hyperparameter",
        "unreduced_grad": "parity departs at step 3 at grad:2.weight, likely cause unreduced",
        "local_clip": "parity departs at step 3 at grad:0.weight, likely cause clipping",
        "low_dtype_state": "parity departs at step 3 at param:0.weight, likely cause dtype",
        "rank_dropout": "parity departs at step 3 at grad:0.weight, likely cause forward",
        "duplicate_data": "parity departs at step 1 at grad:0.weight, likely cause data"}
    for name, text in expected.items():
        assert outs[name].startswith("caught-localised") and text in outs[name], (name, outs[name])
    assert outs["clean"].startswith("clean")
    # every cell passed: the runs, the reference's among them, are not kept
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())

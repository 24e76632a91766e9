"""Tier 3 (CLI): ``distdebug parity`` on every recipe's layout against its own 1-rank reference (issue 50, item 4).

Each recipe at 2 ranks (``--global-batch``: the ranks split one batch) against the same recipe at 1 rank and
that reference's twin: tensor parallelism (DTensors sharded by rows and by columns), a pipeline of two stages
(each stage's layers recorded by its own rank), a hand-written all-reduce, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3
(its partitions, blocks of the flattened parameters), and Lightning (``Trainer(devices=1)`` against
``devices=2``), the GPT (with its clipping) must be equivalent. Each runs at one seed, the five seeds spread over
them (``bench/parity_pairs.py --only recipes`` runs every pair at five: 40 pairs, about 15 minutes, beyond the
suite's budget). A fault beside four clean pairs shows the comparison has teeth where the recording is new (the
learning rate scaled at step 3: found at step 3 in ZeRO-3's partitions and on the pipeline; each rank clipping its
own gradients in the GPT; a gradient never averaged under Lightning's clipping); the ConvNet's per-rank BatchNorm
departs at step 1 with its class named (SyncBatchNorm, its clean twin, is GPU-only).

Needs: 3 launches per recipe (1, 1 and 2 ranks), 4 with a fault: 31 launches of tiny models, 10 steps each.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import DATA, RECIPES, distdebug

SCRIPTS = DATA / "scripts"

PAIRS = {  # name: (script and arguments, seed, a fault in a second candidate: (spec, first departure, cause, said))
    "tensor_parallel": (["tensor_parallel.py", "--global-batch", "8"], 1, None),
    "pipeline": (["pipeline_parallel.py", "--layers", "4", "--global-batch", "8"], 2,
                 ("lr_scaled", "param:0.0.weight", "hyperparameter", "lr 0.1 in the candidate, 0.05")),
    "manual_allreduce": (["manual_allreduce.py", "--global-batch", "16"], 3, None),
    "fsdp2": (["fsdp2_transformer.py", "--global-batch", "8"], 4, None),
    "zero2": (["deepspeed_zero.py", "--zero-stage", "2", "--global-batch", "16"], 0, None),
    "zero3": (["deepspeed_zero.py", "--zero-stage", "3", "--global-batch", "16"], 1,
              ("lr_scaled", "param:0.weight", "hyperparameter", "lr 0.002 in the candidate, 0.001")),
    "gpt": (["gpt_ddp.py", "--global-batch", "4", "--layers", "2", "--dim", "64", "--block", "32"], 3,
            ("local_clip", "grad:tok.weight", "clipping", "each rank clipped by its own gradients' norm")),
    "lightning": (["fw_lightning_parity.py", "--global-batch", "16"], 2,
                  # the ranks' gradients of net.2.weight differ, so do their norms, which Lightning clips by: every
                  # gradient departs, the one never averaged is named
                  ("unreduced_grad", "grad:net.0.weight", "unreduced", "the gradient of net.2.weight differs")),
}


def launch(tmp_path, name: str, mode: str, nproc: int, script: list[str], seed: int, *extra: str) -> None:
    path = (SCRIPTS if script[0].startswith("fw_") else RECIPES) / script[0]
    r = distdebug("attach", "--run-dir", str(tmp_path / name), "--parity", mode, "--nproc-per-node", str(nproc),
                  *extra, str(path), *script[1:], "--seed", str(seed), "--steps", "10", timeout=300)
    assert r.returncode == 0, r.output[-3000:]


def parity(tmp_path, cand: str) -> dict:
    r = distdebug("parity", "--json", str(tmp_path / "ref"), str(tmp_path / cand), "--twin", str(tmp_path / "twin"))
    assert r.returncode in (0, 1), r.output[-3000:]
    got = json.loads(r.stdout)
    assert r.returncode == (0 if got["equivalent"] else 1)
    return got


@pytest.mark.parametrize("name", PAIRS)
def test_every_recipe_at_two_ranks_computes_what_it_computes_at_one(name, tmp_path):
    script, seed, fault = PAIRS[name]
    for module, needed in (("lightning", name == "lightning"), ("deepspeed", name.startswith("zero"))):
        if needed:
            pytest.importorskip(module, reason=f"{module} is not installed (a test extra: pip install -e '.[test]')")
    launch(tmp_path, "ref", "record", 1, script, seed)
    launch(tmp_path, "twin", "twin", 1, script, seed)
    launch(tmp_path, "cand", "record", 2, script, seed)
    got = parity(tmp_path, "cand")
    assert got["equivalent"] and got["causes"] == [], got["text"]
    assert 0 < got["largest"]["ratio"] <= 1 and got["compared"] > 2 * 10, got["text"]  # tensors, not only the loss
    assert got["missing"] == [], got["missing"]  # every tensor of the reference found in the candidate's parts
    if fault is None:
        return
    spec, first, cause, said = fault
    launch(tmp_path, "fault", "record", 2, script, seed, "--inject", spec)
    bad = parity(tmp_path, "fault")
    assert not bad["equivalent"], bad["text"]
    assert (bad["first"]["step"], bad["first"]["quantity"]) == (3, first), bad["text"]
    assert bad["causes"][0]["kind"] == cause and said in bad["causes"][0]["text"], bad["text"]


def test_per_rank_batchnorm_in_a_real_recipe_departs_at_step_one_with_its_class(tmp_path):
    """recipes/ddp_convnet.py: two BatchNorm layers under DDP without SyncBatchNorm. At 2 ranks each normalises by
    its own half of the batch: the first gradient departs at step 1 and the running statistics name the class."""
    script = ["ddp_convnet.py", "--global-batch", "16"]
    for name, mode, nproc in (("ref", "record", 1), ("twin", "twin", 1), ("cand", "record", 2)):
        launch(tmp_path, name, mode, nproc, script, 3)
    got = parity(tmp_path, "cand")
    assert not got["equivalent"] and got["first"]["step"] == 1, got["text"]
    assert got["first"]["quantity"] == "grad:features.0.weight", got["text"]
    assert [c["kind"] for c in got["causes"]] == ["batchnorm"], got["text"]
    assert "features.1.running_mean departs at step 1" in got["cause"], got["text"]

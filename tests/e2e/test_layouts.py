"""Tier 3 (CLI): parallel layouts where ranks are not replicas of each other (issue 21).

Tensor parallelism as torchtitan writes it (``parallelize_module`` with Colwise/Rowwise layers) on a
1-D TP mesh (2 ranks), DDP over the "dp" dimension of a ("dp", "tp") mesh, FSDP2 over it and HSDP x TP
(4 ranks), and pipeline schedules (2 stages; 2 pipelines x 2 stages averaging by hand). Each layout: a
clean run gives no finding and the final parameters of torchrun's run; the layout is discovered and
shown; a NaN born on one rank is one ERROR there and a warning, "received", on every rank it reached;
a bit flip in one data-parallel replica of a TP shard names the step, the tensor, the rank and its
replica peer. The faults of ``distdebug faults replay`` on the layout recipes are checked here too
(the catalogue on the data-parallel recipes is in test_faults).

Needs: the layouts' own sizes: 2 ranks for 1-D TP and a 2-stage pipeline, 4 for the 2-D meshes (2 x 2,
the smallest with both a replica peer and a TP peer). The recipes' default steps; faults at step 2-3
with steps after them.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

import pytest

from tests.e2e.test_attach import kinds
from tests.helpers import DATA, RECIPES, distdebug, incidents_of, read_digests, run

TP = str(RECIPES / "tensor_parallel.py")
PP = str(RECIPES / "pipeline_parallel.py")
MANUAL_TP = str(DATA / "scripts" / "manual_tp.py")
WORLD = {"tp": 2, "ddp_tp": 4, "fsdp_tp": 4, "hsdp_tp": 4}
LABEL = {"tp": "tp=2, TP on w1,w2", "ddp_tp": "dp=2 x tp=2, DDP over dp, TP on w1,w2",
         "fsdp_tp": "dp=2 x tp=2, FSDP2 over dp, TP on w1,w2",
         "hsdp_tp": "dp_replicate=2 x dp_shard=1 x tp=2, FSDP2 over dp_replicate+dp_shard, TP on w1,w2"}
LAYOUT_RECIPES = ("tp", "ddp_tp", "hsdp_tp", "pp", "pp_dp")


def torchrun_n(n: int, *args: str):
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), *args], timeout=240)


def findings(run_dir, world):
    return [f for r in range(world) for f in kinds(run_dir, r, "finding")]


@pytest.mark.alone  # more ranks than cores, judged clean (no straggler): nothing runs beside it
@pytest.mark.parametrize("layout", ["tp", "ddp_tp", "fsdp_tp", "hsdp_tp"])
def test_tensor_parallel_layouts_run_clean_bitwise_and_discovered(tmp_path, layout):
    n = WORLD[layout]
    r = torchrun_n(n, TP, "--layout", layout, "--digest-out", str(tmp_path / "bare"))
    assert r.returncode == 0, r.stderr
    r = distdebug("attach", "--nproc-per-node", str(n), "--run-dir", str(tmp_path / "run"), TP, "--layout", layout,
                  "--digest-out", str(tmp_path / "attached"), timeout=300)
    assert r.returncode == 0, r.output
    assert read_digests(tmp_path / "attached") == read_digests(tmp_path / "bare")
    # TP peers share a batch by design, hold different shards by design: nothing to say
    assert findings(tmp_path / "run", n) == []
    groups = {0: [0], 1: [1]} if layout == "tp" else {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    # hsdp_tp: the FSDP2 mesh (dp_replicate, dp_shard) = (2, 1) through each rank is that rank's dp group
    for rank, group in groups.items():
        (disc,) = kinds(tmp_path / "run", rank, "discovery")
        assert disc["layout"]["label"] == LABEL[layout]
        assert disc["layout"]["data_parallel_group"] == group
        assert disc["layout"]["tensor_parallel"] == ["w1.weight", "w1.bias", "w2.weight"]
        assert disc["models"][0]["parameters"] == 1233  # the full model, whatever the sharding
    report = distdebug("report", str(tmp_path / "run"))
    assert f"layout: {LABEL[layout]}" in report.stdout


# 1-D TP (2 ranks) is the TP peers' path of these two: rank 1's NaN in w1 reaches rank 0 through w2's all-reduce
@pytest.mark.parametrize("layout", ["ddp_tp", "fsdp_tp"])
def test_a_nan_born_on_one_tp_rank_is_one_error_there_and_received_elsewhere(tmp_path, layout):
    n = WORLD[layout]
    r = distdebug("attach", "--nproc-per-node", str(n), "--run-dir", str(tmp_path / "run"), TP, "--layout", layout,
                  "--nan-rank", "1", "--nan-step", "3", timeout=300)
    assert r.returncode == 0, r.output
    nan = [f for f in findings(tmp_path / "run", n) if f["detector"] == "nan_origin" and f["severity"] != "info"]
    errors = [(f["ranks"], f["step"], f["subject"]) for f in nan if f["severity"] == "error"]
    assert errors == [([1], 3, "w1")]  # born in rank 1's shard of the column-parallel w1
    received = {f["ranks"][0]: f for f in nan if f["severity"] == "warning"}
    assert set(received) >= {0, 2, 3}
    assert all(f["step"] == 3 and f["evidence"]["origin"] == "another rank" for f in received.values())
    # rank 0, its TP peer, received it in the forward through w2's (row-parallel) all-reduce
    assert received[0]["subject"] == "w2"
    assert received[0]["evidence"]["received_through"] == "tensor-parallel forward communication"
    if layout == "fsdp_tp":  # rank 3, rank 1's FSDP peer, through the all-gather of rank 1's shard
        assert received[3]["evidence"]["received_through"] == "FSDP parameter all-gather"


@pytest.mark.parametrize("schedule", ["Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_pipeline_schedules_run_clean_and_bitwise(tmp_path, schedule):
    """GPipe, the recipe's default: bitwise under the harness in tests/dist/test_pipeline.py, clean under attach in
    the pipeline script's replay (test_faults) and the parity pairs."""
    # The interleaved schedule runs two stages per rank (rank 0: stages 0 and 2 of 4).
    r = torchrun_n(2, PP, "--schedule", schedule, "--digest-out", str(tmp_path / "bare"))
    assert r.returncode == 0, r.stderr
    r = distdebug("attach", "--run-dir", str(tmp_path / "run"), PP, "--schedule", schedule,
                  "--digest-out", str(tmp_path / "attached"), timeout=300)
    assert r.returncode == 0, r.output
    assert read_digests(tmp_path / "attached") == read_digests(tmp_path / "bare")
    assert findings(tmp_path / "run", 2) == []
    interleaved = schedule == "ScheduleInterleaved1F1B"
    for rank in (0, 1):
        (disc,) = kinds(tmp_path / "run", rank, "discovery")
        indices = [rank, rank + 2] if interleaved else [rank]
        assert disc["layout"]["pipeline"] == {"index": rank, "indices": indices, "stages": 4 if interleaved else 2,
                                              "ranks": [0, 1]}
        assert disc["layout"]["data_parallel_group"] == [rank]  # no other rank holds this stage's layers
        assert [s["step"] for s in kinds(tmp_path / "run", rank, "step")] == [1, 2, 3, 4, 5, 6]
    report = " ".join(distdebug("report", str(tmp_path / "run")).stdout.split())
    assert ("layout: pipeline of 4 stages (rank 0: stages 0, 2, rank 1: stages 1, 3)" if interleaved else
            "layout: pipeline of 2 stages (rank 0: stage 0, rank 1: stage 1)") in report


def test_a_nan_born_in_pipeline_stage_0_is_received_by_stage_1(tmp_path):
    r = distdebug("attach", "--run-dir", str(tmp_path / "run"), PP, "--nan-step", "3", timeout=300)
    assert r.returncode == 0, r.output
    nan = {f["ranks"][0]: f for f in findings(tmp_path / "run", 2)
           if f["detector"] == "nan_origin" and f["severity"] != "info"}
    assert (nan[0]["severity"], nan[0]["step"], nan[0]["subject"]) == ("error", 3, "0")
    assert (nan[1]["severity"], nan[1]["step"]) == ("warning", 3)
    evidence = nan[1]["evidence"]
    assert (evidence["origin"], evidence["received_through"], evidence["from_stage"]) == \
        ("another rank", "pipeline receive", 0)


@pytest.mark.alone  # more ranks than cores, judged clean (no straggler): nothing runs beside it
def test_a_hand_written_layout_is_learned_from_the_gradients_all_reduce(tmp_path):
    # Megatron-style: TP groups (0, 1), (2, 3) and data-parallel groups (0, 2), (1, 3) from new_group,
    # no DTensor, no wrapper. The data-parallel group is the one the gradients were all-reduced over.
    r = distdebug("attach", "--nproc-per-node", "4", "--run-dir", str(tmp_path / "clean"), MANUAL_TP, timeout=300)
    assert r.returncode == 0, r.output
    assert findings(tmp_path / "clean", 4) == []
    for rank in range(4):
        (disc,) = kinds(tmp_path / "clean", rank, "discovery")
        assert disc["layout"]["data_parallel_group"] == [rank % 2, rank % 2 + 2]
        assert disc["layout"]["data_parallel_source"] == "gradient all-reduce"
    r = distdebug("attach", "--nproc-per-node", "4", "--run-dir", str(tmp_path / "flip"), MANUAL_TP,
                  "--flip-rank", "3", "--flip-step", "2", timeout=300)
    assert r.returncode == 0, r.output
    (f,) = [f for f in findings(tmp_path / "flip", 4) if f["severity"] != "info"]
    assert (f["detector"], f["ranks"], f["step"], f["subject"]) == ("replica_divergence", [1, 3], 3, "w2.weight")


@pytest.mark.alone  # more ranks than cores, judged clean (no straggler): nothing runs beside it
def test_a_layout_that_cannot_be_inferred_is_said_and_replica_groups_gives_it(tmp_path):
    # The gradients are all-reduced as one flattened buffer: no gradient names its group. The forward's
    # all-reduce over the TP group shows model parallelism by hand: compared with nobody (never with the
    # TP peers by mistake), and said; --replica-groups gives the groups, and a bit flip is caught again.
    r = distdebug("attach", "--nproc-per-node", "4", "--run-dir", str(tmp_path / "unknown"), MANUAL_TP, "--flat",
                  timeout=300)
    assert r.returncode == 0, r.output
    assert findings(tmp_path / "unknown", 4) == []
    (disc,) = kinds(tmp_path / "unknown", 0, "discovery")
    assert disc["layout"]["data_parallel_source"] == "unknown"
    assert disc["layout"]["model_parallel_by_hand"] == [[0, 1]]
    assert "give --replica-groups" in " ".join(distdebug("report", str(tmp_path / "unknown")).stdout.split())
    r = distdebug("attach", "--nproc-per-node", "4", "--replica-groups", "0,2;1,3", "--run-dir",
                  str(tmp_path / "given"), MANUAL_TP, "--flat", "--flip-rank", "0", "--flip-step", "2", timeout=300)
    assert r.returncode == 0, r.output
    for rank in range(4):
        (disc,) = kinds(tmp_path / "given", rank, "discovery")
        assert (disc["layout"]["data_parallel_group"], disc["layout"]["data_parallel_source"]) == \
            ([rank % 2, rank % 2 + 2], "--replica-groups")
    (f,) = [f for f in findings(tmp_path / "given", 4) if f["severity"] != "info"]
    assert (f["detector"], f["ranks"], f["step"], f["subject"]) == ("replica_divergence", [0, 2], 3, "w2.weight")


@pytest.mark.waits  # its ranks sleep through a stall timeout or a hang: it may run beside a CPU-bound test
def test_a_stalled_pipeline_stage_is_named_with_the_p2p_operation_its_peer_waits_in(tmp_path):
    # Stage 1 stops at the start of step 3; stage 0 blocks in the Work.wait() of its activation send
    # (gloo's isend returns at once: the wait is where it blocks, and is tracked like the operation).
    r = distdebug("attach", "--stall-timeout", "5", "--run-dir", str(tmp_path / "run"), PP,
                  "--stall-rank", "1", "--stall-step", "3", timeout=300)
    assert r.returncode == 124, r.output
    (f,) = [f for f in _all_findings(tmp_path / "run") if f["detector"] == "hang"]  # the launcher's verdict
    assert (f["severity"], f["ranks"], f["step"]) == ("critical", [1], 3)
    assert "rank 0 (pipeline stage 0) is inside isend to rank 1" in f["message"]
    assert "rank 1 (pipeline stage 1) is stuck at step 3 in pipeline_parallel.py" in f["message"]
    assert "disagree" not in f["message"]  # a send meeting a receive is no mismatch


def _all_findings(run_dir):
    import json

    report = distdebug("report", "--json", str(run_dir))
    return json.loads(report.stdout)["findings"]


@pytest.mark.alone  # more ranks than cores, judged clean (no straggler): nothing runs beside it
def test_fault_replay_on_every_layout_recipe(tmp_path):
    # distdebug faults replay on the layout recipes: each clean run has no finding; each fault is caught
    # on the right rank, step and subject. Then, in the kept run directories, what the cells' verdicts
    # do not look at: a bit flip in a TP shard (DDP x TP, HSDP x TP) is named with its replica peer only
    # (never with its TP peers), and a NaN made after the TP all-reduce is born there, not received.
    work = tmp_path / "runs"
    args = [a for e in LAYOUT_RECIPES for a in ("--recipe", e)]
    junit = tmp_path / "faults.xml"
    r = distdebug("faults", "replay", "--keep-runs", "--work-dir", str(work), "--junit", str(junit), *args,
                  timeout=1200)
    assert r.returncode == 0, r.output
    cases = {(c.get("classname").split(".", 1)[1], c.get("name")): c for c in ET.parse(junit).iter("testcase")}
    for engine, name in cases:  # one incident per injected fault (issue 39); a clean run has none
        if (work / f"{name}-{engine}" / "run").is_dir():
            found = incidents_of(work / f"{name}-{engine}" / "run")
            assert len(found) == (name != "clean"), (engine, name, found)
    assert set(cases) == {(e, "clean") for e in LAYOUT_RECIPES} | {
        ("tp", "nan_activation"), ("hsdp_tp", "nan_activation"), ("pp", "nan_activation"),
        ("ddp_tp", "bitflip_param"), ("hsdp_tp", "bitflip_param"), ("pp_dp", "bitflip_param"), ("ddp_tp", "hang")}
    for key, c in cases.items():
        assert c.find("failure") is None, (key, c.find("failure").get("message"))
    assert "7 applicable, 7 caught-localised, 0 not applicable; 5 of 5 clean runs clean; 0 failed" in r.stdout
    # The hang under DDP x TP: rank 1 alone, though its TP peer (rank 0) waits in no collective of ours
    # but for the TP all-reduce's result (wait_tensor), and the Flight Recorder misses both from a later one.
    (h,) = [f for f in _all_findings(work / "hang-ddp_tp" / "run") if f["detector"] == "hang"]
    assert (h["ranks"], h["step"]) == ([1], 3)
    assert "ranks [0] wait for a functional collective (DTensor, tensor parallelism) to complete" in h["message"]
    for recipe in ("ddp_tp", "hsdp_tp"):
        (f,) = [f for f in findings(work / f"bitflip_param-{recipe}" / "run", 4) if f["severity"] != "info"]
        # rank 1 flipped after step 3's update: its dp peer is rank 3 (TP peers 0 and 1 hold other shards)
        assert (f["detector"], f["ranks"], f["step"], f["subject"]) == ("replica_divergence", [1, 3], 3, "w2.weight")
        (t,) = f["evidence"]["tensors"]
        assert t["replica_group"] == [1, 3] and t["groups"] == [[1], [3]]
    # nan_activation poisons w2's output on rank 1 after torch's all-reduce hook (a forward hook of the
    # module's own): what rank 1 gave the all-reduce and got back were finite, so it is born on rank 1;
    # rank 0's forward stays finite and its gradients come back non-finite from the TP backward.
    nan = {f["ranks"][0]: f for f in findings(work / "nan_activation-tp" / "run", 2)
           if f["detector"] == "nan_origin" and f["severity"] != "info"}
    assert (nan[1]["severity"], nan[1]["step"], nan[1]["subject"]) == ("error", 3, "w2")
    assert (nan[0]["severity"], nan[0]["step"], nan[0]["evidence"]["received_through"]) == \
        ("warning", 3, "tensor-parallel backward communication")
    # the pipeline's NaN is born on stage 0 and received by stage 1
    nan = {f["ranks"][0]: f for f in findings(work / "nan_activation-pp" / "run", 2)
           if f["detector"] == "nan_origin" and f["severity"] != "info"}
    assert (nan[0]["severity"], nan[1]["severity"], nan[1]["evidence"]["received_through"]) == \
        ("error", "warning", "pipeline receive")
    # two pipelines averaging by hand: each stage is compared with its replica in the other pipeline
    (disc,) = kinds(work / "clean-pp_dp" / "run", 3, "discovery")
    assert (disc["layout"]["data_parallel_group"], disc["layout"]["pipeline"]["index"]) == ([1, 3], 1)
    report = " ".join(distdebug("report", str(work / "clean-pp_dp" / "run")).stdout.split())
    assert "layout: gradients all-reduced by hand within data-parallel groups [[0, 2], [1, 3]], pipeline of 2 " \
           "stages (rank 0: stage 0, rank 1: stage 1, rank 2: stage 0, rank 3: stage 1)" in report

"""Tier 2 (real gloo ranks, forked): replica divergence found at the exact step, tensor and rank."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from distdebug.artifacts import layout
from distdebug.artifacts.reader import read_events
from distdebug.detectors.replica_divergence import BATCH, ReplicaDivergence
from distdebug.fingerprint.snapshots import read_snapshots
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks


def findings(tmp, rank):
    return [r for r in read_events(layout.events_path(tmp, rank))[0] if r["kind"] == "finding"]


def _ddp(rank, world, tmp, fault=None, fault_rank=1, steps=5, broadcast_buffers=True, lr=0.1, fault_step=3,
         destroy=True):
    from torch.nn.parallel import DistributedDataParallel as DDP

    s = start_session(tmp, rank, detectors=[ReplicaDivergence()])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    ddp = DDP(model, broadcast_buffers=broadcast_buffers)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    for step in range(1, steps + 1):
        if rank == fault_rank and step == fault_step and fault == "bitflip":
            with torch.no_grad():
                model[0].weight.view(-1).view(torch.int32)[5] ^= 1 << 20  # one bit of one parameter
        same_data = fault == "bn_data" and rank != fault_rank
        seed = 100 * step + (0 if same_data else rank + 1)
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
        (model if fault == "unwrapped" else ddp)(x).pow(2).mean().backward()
        opt.step()
        if rank == fault_rank and step == 3 and fault == "momentum":
            opt.state[model[3].bias]["momentum_buffer"].add_(1e-3)  # only optimizer state (lr=0)
        opt.zero_grad()
        if rank == 0 and step == BATCH + 1 and not destroy:
            # The exchange of steps 1-BATCH ran in the background during the training: its finding is
            # there before the end of the run (its thread writes it; give it a moment).
            deadline = time.monotonic() + 20
            while not findings(tmp, 0) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert findings(tmp, 0), "no finding during the run"
    if destroy:
        dist.destroy_process_group()  # as a script ends: the last cross-rank exchange happens here
    s.close(0)


def test_exchanges_run_during_training_and_at_the_end(tmp_path):
    # Steps 1-BATCH go in one exchange during the run, the rest in the last one when the group is destroyed.
    steps = BATCH + 4
    spawn_ranks(_ddp, 3, tmp=tmp_path / "late", fault="bitflip", fault_rank=0, steps=steps, fault_step=BATCH + 2)
    (f,) = findings(tmp_path / "late", 0)
    assert (f["step"], f["subject"], f["ranks"]) == (BATCH + 2, "0.weight", [0])
    spawn_ranks(_ddp, 3, tmp=tmp_path / "early", fault="bitflip", fault_rank=1, steps=steps, destroy=False)
    (f,) = findings(tmp_path / "early", 0)
    assert (f["step"], f["subject"], f["ranks"]) == (3, "0.weight", [1])


def test_one_flipped_bit_on_one_of_three_ranks_is_localised(tmp_path):
    spawn_ranks(_ddp, 3, tmp=tmp_path, fault="bitflip", fault_rank=2)
    (f,) = findings(tmp_path, 0)
    assert (f["detector"], f["step"], f["subject"], f["ranks"]) == ("replica_divergence", 3, "0.weight", [2])
    assert "rank(s) [2] differ from the majority" in f["message"]
    # DDP reduced the gradients (equal everywhere): the flipped bit is a rank-local change after it
    assert "gradients were equal but parameters or buffers differ" in f["message"]
    assert [d["tensor"] for d in f["evidence"]["tensors"]] == ["0.weight"]  # nothing else differs at step 3
    assert findings(tmp_path, 1) == [] and findings(tmp_path, 2) == []  # written once


def test_a_flip_between_the_gradient_checks_is_found_in_its_step_from_the_parameters(tmp_path):
    """After the first 8 checks the gradients and optimizer state are fingerprinted every 8th (issue 18):
    a flip at step 11 is still found at step 11, on its rank, and the finding claims nothing about the
    gradients it did not fingerprint."""
    spawn_ranks(_ddp, 3, tmp=tmp_path, fault="bitflip", fault_rank=2, steps=12, fault_step=11)
    (f,) = findings(tmp_path, 0)
    assert (f["detector"], f["step"], f["subject"], f["ranks"]) == ("replica_divergence", 11, "0.weight", [2])
    assert "gradients and optimizer state were not fingerprinted at this step" in f["message"]
    assert "gradients were equal" not in f["message"]


def test_one_flipped_bit_with_two_ranks_names_both(tmp_path):
    spawn_ranks(_ddp, 2, tmp=tmp_path, fault="bitflip", fault_rank=1)
    (f,) = findings(tmp_path, 0)
    assert (f["step"], f["subject"], f["ranks"]) == (3, "0.weight", [0, 1])
    assert "no majority with 2 ranks" in f["message"]


def test_a_forward_on_the_unwrapped_module_is_named_ddp_reduced_nothing(tmp_path):
    # The DDP wrapper exists, but the loop calls the inner module: DDP's reducer never reduces (a real
    # bug pattern); the gradients differ from step 1 and the finding says why.
    spawn_ranks(_ddp, 2, tmp=tmp_path, fault="unwrapped")
    (f,) = findings(tmp_path, 0)
    assert f["step"] == 1 and "gradients differ while a DDP wrapper exists: DDP reduced nothing" in f["message"], f
    assert any(d["tensor"].endswith(".grad") for d in f["evidence"]["tensors"])


def test_divergence_only_in_optimizer_state(tmp_path):
    spawn_ranks(_ddp, 3, tmp=tmp_path, fault="momentum", fault_rank=1, lr=0.0)
    (f,) = findings(tmp_path, 0)
    assert (f["step"], f["ranks"]) == (4, [1])  # modified after step 3's check
    assert [d["tensor"] for d in f["evidence"]["tensors"]] == ["optimizer.3.bias.momentum_buffer"]


def test_divergence_only_in_batchnorm_buffers(tmp_path):
    spawn_ranks(_ddp, 3, tmp=tmp_path, fault="bn_data", fault_rank=1, broadcast_buffers=False)
    (f,) = findings(tmp_path, 0)
    assert (f["step"], f["ranks"]) == (1, [1])
    assert [d["tensor"] for d in f["evidence"]["tensors"]] == ["1.running_mean", "1.running_var"]


def test_clean_ddp_with_batchnorm_has_no_finding_and_snapshots_agree(tmp_path):
    spawn_ranks(_ddp, 3, tmp=tmp_path)
    for rank in range(3):
        assert findings(tmp_path, rank) == []
    snaps = [read_snapshots(layout.rank_dir(tmp_path, r)) for r in range(3)]
    assert sorted(snaps[0]) == [1, 2, 3, 4, 5]
    names, values = snaps[0][5]
    assert "1.running_mean" in names and "0.weight.grad" in names and "optimizer.0.weight.momentum_buffer" in names
    assert all((snaps[r][5][1] == values).all() for r in (1, 2))


def _skip_step(rank, world, tmp):
    s = start_session(tmp, rank, detectors=[ReplicaDivergence()])
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 6):
        model(torch.ones(1, 2)).sum().backward()
        if not (rank == 1 and step == 3):
            opt.step()
        opt.zero_grad()
    dist.destroy_process_group()  # as a script ends: the last cross-rank exchange happens here
    s.close(0)


def test_rank_that_skips_optimizer_step_is_named(tmp_path):
    spawn_ranks(_skip_step, 3, tmp=tmp_path)
    (f,) = findings(tmp_path, 0)
    assert f["subject"] == "optimizer step count" and f["ranks"] == [1] and f["step"] == 3


def _fsdp(rank, world, tmp, replicate=1, fault=None, fault_rank=1, steps=5):
    """FSDP2 on a (replicate, shard) mesh: replicate=1 is full shard, replicate>1 HSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    s = start_session(tmp, rank, detectors=[ReplicaDivergence()])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    if fault == "gathered":  # registered before the harness's hooks: it sees and alters the gathered weight
        def corrupt(module, args):
            if rank == fault_rank and s.step + 1 == 3:
                with torch.no_grad():
                    module.weight.view(-1)[0] += 1e-3
        model[2].register_forward_pre_hook(corrupt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, steps + 1):
        if fault == "shard" and rank == fault_rank and step == 3:
            with torch.no_grad():
                model[0].weight.to_local().view(-1)[0] += 1e-3  # this rank's copy of its shard only
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()  # as a script ends: the last cross-rank exchange happens here
    s.close(0)


def test_hsdp_compares_shards_within_replicate_groups(tmp_path):
    # 4 ranks, mesh (replicate 2, shard 2): rank r holds shard r % 2; replicas {0, 2} and {1, 3}.
    spawn_ranks(_fsdp, 4, tmp=tmp_path / "clean", replicate=2, timeout=120)
    assert findings(tmp_path / "clean", 0) == []
    names = read_snapshots(layout.rank_dir(tmp_path / "clean", 1))[2][0]
    assert "0.weight@replicas[1,3]" in names and "optimizer.0.weight.exp_avg@replicas[1,3]" in names
    spawn_ranks(_fsdp, 4, tmp=tmp_path / "fault", replicate=2, fault="shard", fault_rank=3, timeout=120)
    (f,) = findings(tmp_path / "fault", 0)
    assert (f["step"], f["subject"], f["ranks"]) == (3, "0.weight", [1, 3])
    assert "within replica group(s) [1, 3]" in f["message"]
    assert {d["tensor"] for d in f["evidence"]["tensors"]} == {"0.weight"}


def test_full_shard_compares_the_gathered_parameters_seen_in_forward(tmp_path):
    spawn_ranks(_fsdp, 2, tmp=tmp_path / "clean", timeout=120)
    assert findings(tmp_path / "clean", 0) == []
    names = read_snapshots(layout.rank_dir(tmp_path / "clean", 0))[2][0]
    assert {"0.weight", "2.weight"} <= set(names)  # unsharded, as forward saw them
    assert not any("exp_avg" in n for n in names)  # shards of optimizer state: never compared
    spawn_ranks(_fsdp, 2, tmp=tmp_path / "fault", fault="gathered", fault_rank=1, timeout=120)
    (f,) = findings(tmp_path / "fault", 0)
    assert (f["step"], f["subject"], f["ranks"]) == (3, "2.weight", [0, 1])

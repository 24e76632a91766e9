"""Tier 2 (real gloo ranks, forked): data sharding mistakes found from the batches themselves."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distdebug.detectors.data_order import DataOrder, identical_batches
from tests.dist.test_replica_divergence import findings
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks


def test_identical_batches_rule():
    per_rank = {0: [[2, 7, 1.0], [3, 8, 1.0]], 1: [[2, 7, 1.0], [3, 9, 1.0]]}
    assert identical_batches(per_rank) == ([2, 3], [2])


def _loop(rank, world, tmp, sampler="distributed", set_epoch=True, init_seed=None, epochs=3, peek=False,
          sloppy_eval=False):
    s = start_session(tmp, rank, detectors=[DataOrder()])
    torch.manual_seed(rank if init_seed == "per_rank" else 0)
    model = nn.Linear(4, 1)  # a hand-written loop: no broadcast of the initial parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g))
    smp = DistributedSampler(data, shuffle=True, seed=0) if sampler == "distributed" else None
    loader = DataLoader(data, batch_size=4, sampler=smp, shuffle=False)
    if peek:
        next(iter(loader))  # a look at one batch before the epoch loop (shapes, a sanity check)
    for epoch in range(epochs):
        if smp is not None and set_epoch:
            smp.set_epoch(epoch)
        for x, y in loader:
            if sloppy_eval:  # a metric on a shared batch, in train mode, grad on, no backward
                model(torch.ones(4, 4)).mean()
            (model(x) - y).pow(2).mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            opt.zero_grad()
    dist.destroy_process_group()
    s.close(0)


def test_clean_sharded_loop_has_no_finding(tmp_path):
    spawn_ranks(_loop, 2, tmp=tmp_path)
    assert findings(tmp_path, 0) == [] and findings(tmp_path, 1) == []


def test_missing_distributed_sampler_is_found(tmp_path):
    spawn_ranks(_loop, 2, tmp=tmp_path, sampler=None)
    (f,) = findings(tmp_path, 0)
    assert (f["detector"], f["subject"], f["ranks"], f["step"]) == ("data_order", "input batches", [0, 1], 2)
    assert "DistributedSampler missing" in f["message"]


def test_same_batches_but_different_init_gives_different_losses(tmp_path):
    spawn_ranks(_loop, 2, tmp=tmp_path, sampler=None, init_seed="per_rank")
    by_subject = {f["subject"]: f for f in findings(tmp_path, 0)}
    assert by_subject["loss"]["severity"] == "error" and by_subject["loss"]["step"] == 2
    assert "not the same model" in by_subject["loss"]["message"]


def test_a_forward_whose_output_never_reaches_backward_is_not_the_steps_batch(tmp_path):
    # Every rank runs the same (shared) batch through the model before its training forward, grad on,
    # train mode: the step's batch is the one whose output reached the backward, not that one.
    spawn_ranks(_loop, 2, tmp=tmp_path, sloppy_eval=True, init_seed="per_rank")
    assert findings(tmp_path, 0) == [] and findings(tmp_path, 1) == []


def test_a_peek_before_the_epoch_loop_is_not_a_pass(tmp_path):
    # next(iter(loader)) before the loop, then set_epoch(0) and the loop's own first pass: not a repeat.
    spawn_ranks(_loop, 2, tmp=tmp_path / "peek", peek=True)
    assert findings(tmp_path / "peek", 0) == [] and findings(tmp_path / "peek", 1) == []
    spawn_ranks(_loop, 2, tmp=tmp_path / "peek_no_set_epoch", peek=True, set_epoch=False)
    (f,) = findings(tmp_path / "peek_no_set_epoch", 0)  # a real repeat is still found
    assert f["subject"] == "DistributedSampler.set_epoch"


def test_set_epoch_never_called_is_found_with_its_place(tmp_path):
    spawn_ranks(_loop, 2, tmp=tmp_path, set_epoch=False)
    for rank in (0, 1):
        (f,) = findings(tmp_path, rank)
        assert (f["subject"], f["severity"]) == ("DistributedSampler.set_epoch", "warning")
        assert "test_data_order.py" in f["evidence"]["where"]

"""Tier 2 (real gloo ranks, forked): data sharding mistakes found from the batches themselves."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distdebug.detectors.data_order import DataOrder, identical_batches
from distdebug.fault_injection.probe import Probe
from tests.dist.test_replica_divergence import findings
from tests.dist.test_session import start_session
from tests.helpers import spawn_ranks

TUTORIAL = Path(__file__).parents[1] / "data" / "scripts" / "ddp_tutorial.py"


def _line(path, marker):
    """'file.py:N' of the line holding ``marker``: where a finding must place the loop."""
    lines = Path(path).read_text().splitlines()
    return f"{Path(path).name}:{next(i for i, t in enumerate(lines, 1) if marker in t)}"


def test_identical_batches_rule():
    per_rank = {0: [[2, 7, 1.0], [3, 8, 1.0]], 1: [[2, 7, 1.0], [3, 9, 1.0]]}
    assert identical_batches(per_rank) == ([2, 3], [2])


def _loop(rank, world, tmp, sampler="distributed", set_epoch=True, init_seed=None, epochs=3, peek=None,
          sloppy_eval=False, val=False, steps_per_epoch=None, rebuild=False, probe=False):
    # probe: the replay's clean cell (faults replay), whose probe wraps the DataLoader iterator's __next__
    s = start_session(tmp, rank, detectors=[*([Probe()] if probe else []), DataOrder()])
    torch.manual_seed(rank if init_seed == "per_rank" else 0)
    model = nn.Linear(4, 1)  # a hand-written loop: no broadcast of the initial parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g))

    def build():
        smp = DistributedSampler(data, shuffle=True, seed=0) if sampler == "distributed" else None
        return smp, DataLoader(data, batch_size=4, sampler=smp, shuffle=False)

    smp, loader = build()
    # a validation loader over the same data, same seed, shuffled and never given set_epoch: its order
    # does not matter (the metric is a mean), and it is not trained on
    val_loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=True, seed=0))
    if peek == "start":
        next(iter(loader))  # a look at one batch before the epoch loop (shapes, a sanity check)
    for epoch in range(epochs):
        if rebuild and epoch:
            smp, loader = build()  # a new DataLoader and sampler every epoch
        if smp is not None and set_epoch:
            smp.set_epoch(epoch)
        if peek == "after_set_epoch":
            next(iter(loader))
        for i, (x, y) in enumerate(loader):  # THE LOOP
            if i == steps_per_epoch:
                break  # an epoch cut short on purpose (max_steps per epoch)
            if peek == "in_loop" and i == 3:
                next(iter(loader))  # a look at the loader's first batch in the middle of an epoch
            if sloppy_eval:  # a metric on a shared batch, in train mode, grad on, no backward
                model(torch.ones(4, 4)).mean()
            (model(x) - y).pow(2).mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            opt.zero_grad()
        if val:
            with torch.no_grad():
                for x, _ in val_loader:
                    model(x)
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


# The quick tier keeps one shape of each family (the in-loop peek; the tutorial's peek before set_epoch); the
# others run in the full suite (CI).
@pytest.mark.parametrize("peek", [pytest.param("start", marks=pytest.mark.slow),
                                  pytest.param("after_set_epoch", marks=pytest.mark.slow), "in_loop"])
def test_a_peek_is_not_a_pass(peek, tmp_path):
    # next(iter(loader)) before the loop, every epoch after set_epoch, or inside the loop: no training step
    # follows it, so it is no epoch; the loop's passes differ. (Every epoch before set_epoch, the DDP
    # tutorial's batch-size peek: test_the_ddp_tutorial_...)
    spawn_ranks(_loop, 2, tmp=tmp_path / "clean", peek=peek, epochs=2)
    assert findings(tmp_path / "clean", 0) == [] and findings(tmp_path / "clean", 1) == []
    spawn_ranks(_loop, 2, tmp=tmp_path / "fault", peek=peek, set_epoch=False, epochs=2)
    (f,) = findings(tmp_path / "fault", 0)  # a real repeat is still found: the loop's second pass
    assert (f["subject"], f["step"]) == ("DistributedSampler.set_epoch", 7)
    assert f["evidence"]["where"] == f["evidence"]["earlier_where"] == _line(__file__, "# THE LOOP")


def test_set_epoch_never_called_is_found_with_its_place(tmp_path):
    # Under the replay's probe, which wraps the DataLoader iterator's __next__: still the user's line.
    spawn_ranks(_loop, 2, tmp=tmp_path, set_epoch=False, probe=True)
    for rank in (0, 1):
        (f,) = findings(tmp_path, rank)
        assert (f["subject"], f["severity"], f["step"]) == ("DistributedSampler.set_epoch", "warning", 7)
        assert (f["evidence"]["epoch"], f["evidence"]["earlier_step"]) == (0, 1)
        assert f["evidence"]["where"] == _line(__file__, "# THE LOOP"), f


def test_a_validation_loader_without_set_epoch_is_not_a_finding(tmp_path):
    # Its shuffled order repeats every epoch, but no step trains on it: it runs whole between two steps.
    spawn_ranks(_loop, 2, tmp=tmp_path, val=True, epochs=2)
    assert findings(tmp_path, 0) == [] and findings(tmp_path, 1) == []


@pytest.mark.slow  # a shape of the family: full suite only
def test_epochs_cut_short_count_for_the_steps_they_fed(tmp_path):
    # An epoch stopped after 2 of its 6 batches on purpose: with set_epoch, clean; without, the second
    # epoch trains on the first one's batches again.
    spawn_ranks(_loop, 2, tmp=tmp_path / "clean", steps_per_epoch=2)
    assert findings(tmp_path / "clean", 0) == []
    spawn_ranks(_loop, 2, tmp=tmp_path / "fault", steps_per_epoch=2, set_epoch=False)
    (f,) = findings(tmp_path / "fault", 0)
    assert (f["subject"], f["step"]) == ("DistributedSampler.set_epoch", 3)


@pytest.mark.slow  # a shape of the family: full suite only
def test_a_sampler_built_anew_every_epoch_repeats_its_order_without_set_epoch(tmp_path):
    # The order is a function of the dataset, the seed and the epoch, not of the sampler object.
    spawn_ranks(_loop, 2, tmp=tmp_path / "clean", rebuild=True, epochs=2)
    assert findings(tmp_path / "clean", 0) == []
    spawn_ranks(_loop, 2, tmp=tmp_path / "fault", rebuild=True, set_epoch=False, epochs=2)
    (f,) = findings(tmp_path / "fault", 0)
    assert (f["subject"], f["step"]) == ("DistributedSampler.set_epoch", 7)


def _tutorial(rank, world, tmp, set_epoch):
    s = start_session(tmp, rank, detectors=[Probe(), DataOrder()])  # as in the replay's clean cell
    spec = importlib.util.spec_from_file_location("ddp_tutorial", TUTORIAL)
    tutorial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tutorial)
    tutorial.main(total_epochs=2, batch_size=32, set_epoch=set_epoch)
    dist.destroy_process_group()
    s.close(0)


def test_the_ddp_tutorial_peek_then_set_epoch_is_clean_and_its_fault_twin_found(tmp_path):
    spawn_ranks(_tutorial, 2, tmp=tmp_path / "clean", set_epoch=True)
    assert findings(tmp_path / "clean", 0) == [] and findings(tmp_path / "clean", 1) == []
    spawn_ranks(_tutorial, 2, tmp=tmp_path / "fault", set_epoch=False)
    for rank in (0, 1):  # 256 samples, 2 ranks, batches of 32: epoch 1 starts at step 5
        (f,) = findings(tmp_path / "fault", rank)
        assert (f["subject"], f["step"], f["evidence"]["earlier_step"]) == ("DistributedSampler.set_epoch", 5, 1)
        assert f["evidence"]["where"] == _line(TUTORIAL, "# THE LOOP"), f

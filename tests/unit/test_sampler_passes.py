"""Tier 1 (pure): which passes over a DistributedSampler a training step trained on (data_order's
``SamplerPasses``), driven by the order of indices and step boundaries alone; the user's line behind a
call (runtime.callsite); the advice's check naming only what each data_order finding holds."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

from distdebug.detectors.data_order import SamplerPasses
from distdebug.findings import Finding, Severity
from distdebug.report import knowledge as kb
from distdebug.runtime.callsite import internal, user_site

DATA = object()


def sampler(epoch=0, seed=0, shuffle=True):
    return SimpleNamespace(dataset=DATA, total_size=24, seed=seed, num_replicas=2, rank=0, epoch=epoch,
                           shuffle=shuffle)


class Run:
    """A script's data loading and steps, as the detector sees them."""

    def __init__(self):
        self.passes, self.step, self.repeats = SamplerPasses(), 0, []

    def iterate(self, smp, where="loop"):
        return self.passes.counted(iter(range(12)), self.passes.start(smp, where))

    def take(self, it, n=4):
        return [next(it) for _ in range(n)]

    def boundary(self):
        self.step += 1
        self.repeats += [(p.step, p.where, b.step, b.where) for p, b in self.passes.boundary(self.step)]

    def train(self, it, steps=3):
        for _ in range(steps):
            self.take(it)
            self.boundary()

    def end(self):
        self.repeats += [(p.step, p.where, b.step, b.where) for p, b in self.passes.end()]
        return self.repeats


def test_epochs_with_one_order_repeat_and_peeks_do_not_count():
    for set_epoch in (True, False):
        run, smp = Run(), sampler()
        for epoch in range(3):
            run.take(run.iterate(smp, "peek"))  # the DDP tutorial's peek at a batch, before set_epoch
            smp.epoch = epoch if set_epoch else 0
            run.train(run.iterate(smp))
        # without set_epoch: each repeat (its first step, the earlier pass's), told when its order moves again
        assert run.end() == ([] if set_epoch else [(4, "loop", 1, "loop"), (7, "loop", 4, "loop")])


def test_a_look_inside_the_loop_is_not_an_epoch():
    run, smp = Run(), sampler()
    it = run.iterate(smp)
    run.take(it)
    run.boundary()
    run.take(it)
    run.take(run.iterate(smp, "look"))  # after the step's batch, before its boundary
    run.boundary()
    run.train(it, 1)  # the loop goes on
    smp.epoch = 1
    run.train(run.iterate(smp), 2)
    assert run.end() == []


def test_validation_between_epochs_and_drained_epochs():
    run, train, val = Run(), sampler(), sampler()  # val: the same data and seed, never set_epoch
    for epoch in range(2):
        train.epoch = epoch
        it = run.iterate(train)
        drained = [*it]  # DataLoader workers fetched the whole epoch's indices ahead
        assert len(drained) == 12
        run.boundary()
        run.boundary()  # a second optimizer's step: nothing moved
        [*run.iterate(val, "val")]  # runs whole between two steps
    assert run.end() == []
    (epochs,) = run.passes.trained.values()  # one order: the validation's pass was never trained on
    assert set(epochs) == {0, 1} and all(p.where == "loop" for p in epochs.values())


def test_an_epoch_cut_short_counts_and_a_repeat_at_the_end_is_told():
    run, smp = Run(), sampler()
    it = run.iterate(smp)
    run.train(it, 2)
    run.take(it)  # fetched, then the loop breaks (max_steps)
    run.train(run.iterate(smp), 1)  # no set_epoch, the last step of the run
    assert run.end() == [(3, "loop", 1, "loop")]


def test_shuffle_and_seed_are_part_of_the_order():
    run = Run()
    run.train(run.iterate(sampler(seed=0)), 1)
    run.train(run.iterate(sampler(seed=1)), 1)  # a new sampler, another seed: another order
    assert run.end() == []
    run = Run()
    run.train(run.iterate(sampler()), 1)
    run.train(run.iterate(sampler()), 1)  # a new sampler, the same seed and epoch: the same order
    assert run.end() == [(2, "loop", 1, "loop")]


def test_the_user_site_skips_ours_torch_and_the_standard_library():
    import distdebug.fault_injection.probe as probe

    assert internal(probe.__file__) and internal(torch.__file__) and internal(os.__file__)
    assert internal(sys.modules["distdebug"].__file__ or "") and not internal(__file__)
    site = user_site(0)
    assert site is not None and site[0] == __file__ and site[2] == "test_the_user_site_skips_ours_torch_and_the_" \
        "standard_library"
    # a user whose project lives in a folder named like ours is still the user
    assert not internal(os.path.join(os.sep, "home", "u", "distdebug", "train.py"))


def test_each_data_order_check_names_what_its_finding_holds():
    def finding(subject, **evidence):
        return Finding(severity=Severity.WARNING, detector="data_order", ranks=[0], step=7, subject=subject,
                       message="m", evidence=evidence)

    set_epoch = kb.advise(finding("DistributedSampler.set_epoch", epoch=0, where="t.py:9", step=7,
                                  earlier_where="t.py:9", earlier_step=1))
    batches = kb.advise(finding("input batches", steps=[2, 4, 8], ranks=[0, 1]))
    loss = kb.advise(finding("loss", losses={0: 1.0, 1: 2.0}, rtol=1e-5))
    for a in (set_epoch, batches, loss):
        assert "digest" not in a.check, a
    assert "where" in set_epoch.check and "set_epoch" in set_epoch.cause
    assert "steps" in batches.check and "loss" in loss.check and "--step 7" in loss.check


def test_an_evaluation_pass_under_no_grad_is_never_trained_on_even_when_it_alone_moved():
    """Training from an IterableDataset (no watched sampler) and a DistributedSampler(val, shuffle=True)
    evaluated between steps without set_epoch: its pass is the only one that moved, run whole; taken under
    no_grad (an evaluation loop iterates its loader inside the block), it is no epoch. The same passes
    taken with autograd on are trained on, and repeat."""
    for grad in (False, True):
        run, val = Run(), sampler()
        for _ in range(4):
            run.boundary()  # training steps from a loader that is not watched
            with torch.set_grad_enabled(grad):
                list(run.iterate(val, "val"))
        run.boundary()
        assert bool(run.end()) is grad


def test_what_is_remembered_stays_bounded_whatever_the_loop():
    """set_epoch(step) and a batch every step, for many steps; samplers of ever new seeds: the epochs and
    orders remembered stay within their bounds."""
    from distdebug.detectors import data_order

    run, smp = Run(), sampler()
    for step in range(data_order.MAX_EPOCHS * 2):
        smp.epoch = step
        run.take(run.iterate(smp), 1)
        run.boundary()
    assert all(len(e) <= data_order.MAX_EPOCHS for e in run.passes.trained.values())
    for seed in range(data_order.MAX_ORDERS * 2):
        run.take(run.iterate(sampler(seed=seed)), 1)
        run.boundary()
    assert len(run.passes.trained) <= data_order.MAX_ORDERS and run.end() == []

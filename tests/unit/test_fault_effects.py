"""Tier 1 (pure): what a fault can show on a script, decided from the clean run (issue 46: a loss that never
moves, samples the ranks could never share, a parameter nobody else holds), and a fault that checks, after its
step, whether what it did reached what the training uses (loss_spike: the loss the script backpropagated)."""

from __future__ import annotations

import torch

from distdebug.context import RankContext, RankIdentity, StepEvent
from distdebug.fault_injection.facts import Facts, Sample
from distdebug.fault_injection.loss_spike import LossSpike
from distdebug.fault_injection.probe import _digest
from distdebug.fault_injection.registry import FAULTS

BASE = dict(steps=20, world=2, backend="gloo", exit_code=0, wrappers={"ddp"}, replicas=2, optimizers=1, loss=True,
            loss_ranks={0, 1}, dataloader=True, distributed_sampler=True, manual_seed=True,
            targets={0: ("fc.weight", "fc"), 1: ("fc.weight", "fc")})


def test_a_loss_that_never_moves_cannot_show_a_spike_and_one_that_moves_can():
    zero = Facts(**BASE, losses={0: (0.0, 0.0), 1: (0.0, 0.0)})  # the DDP tutorial's cross-entropy over 1 column
    reason = FAULTS["loss_spike"].applicable(zero)
    assert reason.startswith("the clean run's loss was 0 at every step on every rank")
    assert "single output column" in reason
    flat = Facts(**BASE, losses={0: (2.5, 2.5), 1: (2.5, 2.5)})
    assert "was 2.5 at every step" in FAULTS["loss_spike"].applicable(flat)
    for moving in ({0: (0.0, 0.0), 1: (0.0, 1e-3)}, {0: (-3.0, -2.0), 1: (-3.1, -2.2)}, {0: (1.0, 1.0), 1: (2.0, 2.0)}):
        assert FAULTS["loss_spike"].applicable(Facts(**BASE, losses=moving)) == ""  # a negative loss moves too


def test_samples_the_ranks_could_never_share_make_duplicate_data_not_applicable():
    dup = FAULTS["duplicate_data"]

    def facts(*samples: Sample) -> Facts:
        return Facts(**BASE, samples=dict(enumerate(samples)))

    assert dup.applicable(facts(Sample("a", True), Sample("a", True))) == ""
    assert dup.applicable(Facts(**BASE)) == ""  # not read (an IterableDataset): not ruled out
    # A random augmentation from the global generators, seeded alike on every rank (the imagenet example's
    # --seed): the same indices draw the same crops, data_order sees the same batches.
    assert dup.applicable(facts(Sample("a", True, True, "s"), Sample("a", True, True, "s"))) == ""
    # ... from each rank's own random state: never the same batch.
    own = dup.applicable(facts(Sample("a", True, True, "s0"), Sample("a", True, True, "s1")))
    assert own.startswith("its samples are drawn with random numbers (an augmentation) from each rank's own")
    assert dup.applicable(facts(Sample("a", True, False, "s0"), Sample("a", True, False, "s1"))) == ""  # no draw
    fresh = dup.applicable(facts(Sample("a", False), Sample("b", False)))
    assert fresh.startswith("its dataset returns a different sample each time the same index is read, even from")
    unseeded = dup.applicable(facts(Sample("a", True), Sample("b", True)))  # the DDP tutorial's torch.rand
    assert unseeded.startswith("the ranks' datasets hold different samples at the same index")


def test_a_sample_digest_is_equal_for_equal_samples_whatever_their_shape():
    a = (torch.arange(6.0).reshape(2, 3), {"label": 3, "mask": torch.tensor([True, False])}, "id-1")
    b = (torch.arange(6.0).reshape(2, 3), {"mask": torch.tensor([True, False]), "label": 3}, "id-1")
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest((torch.arange(6.0).reshape(3, 2), *a[1:]))  # the shape counts
    assert _digest(torch.tensor(1.0, dtype=torch.bfloat16)) != _digest(torch.tensor(1.0))
    assert _digest(torch.zeros(0)) == _digest(torch.zeros(0))


def test_a_parameter_nobody_else_holds_is_said_from_the_probe():
    assert Facts(**{**BASE, "param_replicas": {1: []}}).replicas_of_param() == (
        "no other rank holds the values of fc.weight (each rank holds a shard of its own)")
    assert Facts(**{**BASE, "param_replicas": {1: "every rank"}}).replicas_of_param() == ""
    assert Facts(**{**BASE, "param_replicas": {1: [1, 3]}}).replicas_of_param() == ""
    flip = FAULTS["bitflip_param"]
    full_shard = Facts(**{**BASE, "wrappers": {"fsdp2"}, "param_replicas": {0: [], 1: []}})
    assert flip.applicable(full_shard) == ("no other rank holds the values of fc.weight (each rank holds a shard of "
                                           "its own): a flipped bit has nothing to be compared with")
    hsdp = Facts(**{**BASE, "wrappers": {"fsdp2"}, "param_replicas": {0: [0, 2], 1: [1, 3]}})
    assert flip.applicable(hsdp) == ""  # HSDP: a replica group to compare with
    # ZeRO-1/2 replicate the parameters: replayed (the fault says if its flip survived); ZeRO-3 partitions them.
    assert flip.applicable(Facts(**{**BASE, "wrappers": {"deepspeed"}, "zero_stage": 2})) == ""
    assert flip.applicable(Facts(**{**BASE, "wrappers": {"deepspeed"}, "zero_stage": 3})).startswith(
        "DeepSpeed ZeRO-3 partitions every parameter")


class _Ctx:
    """A rank's context whose event stream is a list (the fault writes its records through ``emit``)."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        me = RankIdentity(rank=1, local_rank=1, world_size=2, local_world_size=2, node=0, attempt=0, host="h", pid=1)
        self.ctx = RankContext(identity=me, run_dir=None, rank_dir=None,
                               emit=lambda kind, **f: self.records.append({"kind": kind, **f}))

    def said(self) -> list[str]:
        return [r["reason"] for r in self.records if r["kind"] == "not_acted"]


def _event(step: int, loss: float | None, backward_calls: int = 1) -> StepEvent:
    return StepEvent(rank=1, step=step, loss=loss, step_time_s=0.1, backward_calls=backward_calls, collectives=0)


def _steps(fault: LossSpike, losses: list[float]) -> None:
    for i, loss in enumerate(losses, start=1):
        fault.on_step(_event(i, loss))


def test_loss_spike_says_when_its_corruption_never_reached_the_backward_or_did_not_spike():
    w = torch.ones(3, requires_grad=True)

    def step(fault: LossSpike, backward_on_output: bool, loss_of: object) -> None:
        out = fault._post(None, (), (w * 2, (w * 2).sum()))  # (logits, loss), the model's own
        target = out[1] if backward_on_output else (w * 3).sum()  # ... or a loss from something else
        target.backward()
        fault.on_step(_event(5, loss_of(out)))

    # The loss the script backpropagates is the model's: x30 in magnitude. Acted, nothing said.
    ok = _Ctx()
    fault = LossSpike(step=5)
    fault.setup(ok.ctx)
    _steps(fault, [6.0, 6.1, 5.9, 6.0])
    step(fault, True, lambda out: float(out[1]))
    assert fault.acted and ok.said() == []
    # A loss the script computes from something else than the model's output: the backward never reached it.
    other = _Ctx()
    fault = LossSpike(step=5)
    fault.setup(other.ctx)
    _steps(fault, [6.0, 6.1, 5.9, 6.0])
    step(fault, False, lambda out: 9.0)
    assert other.said() == ["the model's output corrupted in step 5 never reached the loss the script called "
                            "backward() on: the script computes its loss from something else than what the model "
                            "returns"]
    # Reached, but the loss does not grow with the output (an offset dominates it): said with the numbers.
    flat = _Ctx()
    fault = LossSpike(step=5)
    fault.setup(flat.ctx)
    _steps(fault, [-6.0, -6.1, -5.9, -6.0])
    step(fault, True, lambda out: -6.3)
    assert len(flat.said()) == 1 and flat.said()[0].startswith(
        "the loss the script backpropagated in step 5 went from about 6 to -6.3 in magnitude (x1.1)")
    # A negative loss x30 further from zero is a spike in magnitude: nothing said.
    neg = _Ctx()
    fault = LossSpike(step=5)
    fault.setup(neg.ctx)
    _steps(fault, [-6.0, -6.1, -5.9, -6.0])
    step(fault, True, lambda out: -180.0)
    assert neg.said() == []


def test_what_can_show_is_read_from_the_probe_run_records():
    """The clean run's records: its losses per rank, the dataset's first sample read twice, the replicas of the
    parameter a fault aims at (the probe's ``targets`` fact)."""
    from distdebug.artifacts.reader import RankStream, Run

    def stream(rank: int, losses: list[float], digest: str, replicas: object) -> RankStream:
        return RankStream(rank, [
            {"kind": "start", "rank": rank, "world_size": 2},
            *[{"kind": "step", "step": s, "loss": v, "collectives": 0} for s, v in enumerate(losses, start=1)],
            {"kind": "probe", "fact": "targets", "param": "fc.weight", "module": "fc", "param_replicas": replicas},
            {"kind": "probe", "fact": "dataloader", "sampler": "DistributedSampler", "distributed": True},
            {"kind": "probe", "fact": "dataset_sample", "digest": digest, "repeatable": True, "random": False,
             "rng": "s", "sharded": True},
            {"kind": "end", "exit_code": 0}])

    tutorial = Facts.load(Run(path=None, manifest=None, nodes={}, ranks={
        0: stream(0, [0.0] * 8, "a", "every rank"), 1: stream(1, [0.0] * 8, "b", "every rank")}))
    assert tutorial.losses == {0: (0.0, 0.0), 1: (0.0, 0.0)} and tutorial.constant_loss() == 0.0
    assert tutorial.samples == {0: Sample("a", True, False, "s"), 1: Sample("b", True, False, "s")}
    assert FAULTS["loss_spike"].applicable(tutorial).startswith("the clean run's loss was 0 at every step")
    assert FAULTS["duplicate_data"].applicable(tutorial).startswith("the ranks' datasets hold different samples")
    assert tutorial.replicas_of_param() == ""
    sharded = Facts.load(Run(path=None, manifest=None, nodes={}, ranks={
        0: stream(0, [-3.0, -3.5, float("nan")], "a", []), 1: stream(1, [-3.1, -3.6], "a", [])}))
    assert sharded.losses == {0: (-3.5, -3.0), 1: (-3.6, -3.1)} and sharded.constant_loss() is None
    assert sharded.param_replicas == {0: [], 1: []} and sharded.replicas_of_param().startswith("no other rank holds")
    assert FAULTS["duplicate_data"].applicable(sharded) == ""


def test_parity_faults_that_need_data_parallel_peers_say_so_where_there_are_none():
    """grad_summed, unreduced_grad and local_clip act through the ranks of a data-parallel group: where a rank has
    no peer in it (tensor parallelism alone, a pipeline: runtime.layout's group is this rank only) each says why it
    does not act instead of claiming an effect; with every rank one group (DDP) they act."""
    from distdebug.fault_injection.local_clip import LocalClip
    from distdebug.runtime.layout import Layout

    model = torch.nn.Linear(2, 1)  # held here: the context keeps models weakly

    def attached(cls, dp: list[int] | None, **params) -> tuple[object, _Ctx]:
        c = _Ctx()
        c.ctx.models = [model]
        c.ctx.layout = Layout(rank=1, world=2, dp=dp)
        fault = cls(**params)
        fault.attach(c.ctx)
        return fault, c

    alone = [1]  # tensor parallelism alone: nobody else holds this rank's batch
    fault, c = attached(FAULTS["grad_summed"], alone)
    assert c.said() == ["no other rank shares this rank's data-parallel group: a sum over it is its average"]
    fault, c = attached(FAULTS["grad_summed"], None)  # DDP over both ranks: x2
    assert c.said() == [] and fault.factor == 2
    fault, c = attached(FAULTS["unreduced_grad"], alone)
    assert c.said()[0].startswith("no other rank shares weight's data-parallel group")
    fault, c = attached(FAULTS["unreduced_grad"], None)
    assert c.said() == [] and fault.target is not None
    fault, c = attached(LocalClip, alone)
    assert c.said()[0].startswith("the ranks are not all one data-parallel group")
    fault, c = attached(LocalClip, None, rank=1)  # its all-reduce needs every rank
    assert c.said() == ["it acts on every rank (rank=-1): its average over the ranks needs each rank's gradients"]

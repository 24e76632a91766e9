"""Tier 1 (no processes): the session's rooms, each on its own (issue 47, item 2): the step clock's loss
averaging and counters on CPU tensors, training phases' rival rule and change-over, the finder's notes,
re-execution's flags restored whatever happens, which call ends a step, the detector loop's guard, and the
session delegating to them under its old names."""

from __future__ import annotations

import sys

import pytest
import torch

from distdebug.context import RankContext, RankIdentity
from distdebug.runtime import cost
from distdebug.runtime.clock import StepClock, bare_step_record, not_a_training_step, step_record
from distdebug.runtime.detector import Detector
from distdebug.runtime.finder import Finder
from distdebug.runtime.phases import Phases
from distdebug.runtime.progress import Progress
from distdebug.runtime.reexecution import Reexecution

IDENTITY = RankIdentity(rank=0, local_rank=0, world_size=1, local_world_size=1, node=0, attempt=0, host="h", pid=1)


def read(clock: StepClock, detectors=(), off=False):
    failed: list[BaseException] = []
    out = clock.read(list(detectors), cost.Ledger(), 1, off, failed.append)
    assert failed == []
    return out


# ------------------------------------------------------------------ the step clock
def test_the_clock_averages_the_losses_of_a_step_and_starts_the_next_from_zero():
    clock = StepClock()
    for v in (1.0, 2.0, 6.0):
        clock.count_backward()
        clock.add_loss(torch.tensor(v, requires_grad=True) * 1, sys._getframe())
    clock.add_loss(torch.ones(3), sys._getframe())  # not a scalar: not a loss
    clock.add_loss(None, sys._getframe())
    assert clock.loss_sum.dtype == torch.float64 and clock.loss_n == 3
    loss, per_detector, scale = read(clock)
    assert loss == pytest.approx(3.0) and per_detector == {} and scale is None
    progress = Progress()
    progress.collective_seq = 5
    clock.start()
    t0 = clock.t_last
    event = clock.close_step(0, 1, t0 + 0.25, progress, loss, per_detector, False, None)
    assert (event.step, event.loss, event.backward_calls, event.collectives, event.backward_total) == (1, 3.0, 3, 5, 3)
    assert event.step_time_s == pytest.approx(0.25)
    # reset for the next step; the running totals and the collectives' mark go on
    assert (clock.loss_sum, clock.loss_n, clock.backward_calls, clock.reduced_at) == (None, 0, 0, False)
    assert clock.backward_total == 3 and clock.seq_at_boundary == 5 and clock.t_last == t0 + 0.25
    progress.collective_seq = 7
    clock.count_backward()
    event = clock.close_step(0, 2, t0 + 0.5, progress, None, {}, False, None)
    assert (event.collectives, event.backward_calls, event.backward_total) == (2, 1, 4)


def test_the_clock_divides_a_scalers_scale_out_and_reads_the_scale():
    class Scaler:
        _enabled = True
        _scale = torch.tensor(1024.0)

    clock, scaler = StepClock(), Scaler()
    out = torch.tensor(3.0) * scaler._scale
    clock.note_scaled(scaler, out)
    clock.add_loss(out, sys._getframe())
    loss, _, scale = read(clock)
    assert loss == 3.0 and scale == 1024.0
    disabled = Scaler()
    disabled._enabled = False
    clock.note_scaled(disabled, out)  # a disabled scaler is no scaler
    assert len(clock.scaled) == 1


def test_the_clock_takes_an_explicit_loss_and_reads_none_when_the_harness_is_off():
    clock = StepClock()
    clock.explicit(2.5)
    assert read(clock)[0] == 2.5
    clock.explicit(torch.tensor(4.0))
    assert read(clock)[0] == 4.0
    assert read(clock, off=True)[0] is None  # --measure-overhead's off block: nothing read


def test_the_clock_reads_each_detectors_probe_in_the_one_read():
    class Probe(Detector):
        name = "probe"

        def probe(self, step):
            return {"x": torch.tensor(float(step))}

    clock = StepClock()
    assert read(clock, [Probe()])[1] == {"probe": {"x": 1.0}}


def test_the_step_records_fields():
    clock = StepClock()
    event = clock.close_step(3, 7, 1.0, Progress(), 0.5, {}, True, 8.0)
    rec = step_record(event, 2, skipped=True, off=True)
    assert {k: rec[k] for k in ("kind", "rank", "step", "attempt", "loss", "backward_calls", "collectives")} == \
        {"kind": "step", "rank": 3, "step": 7, "attempt": 2, "loss": 0.5, "backward_calls": 0, "collectives": 0}
    assert rec["skipped"] is True and rec["harness"] == "off" and rec["loss_scale"] == 8.0
    plain = step_record(event, 0, skipped=False, off=False)
    assert "skipped" not in plain and "harness" not in plain
    bare = bare_step_record(1, 4, 0)
    assert (bare["step"], bare["loss"], bare["backward_calls"]) == (4, None, 0)


def test_a_step_called_by_torchs_checkpoint_helpers_is_not_a_training_step():
    """torch.distributed.checkpoint's _init_optim_state steps once to create the optimizer's state: found by
    walking up from the optimizer's post-hook (the hook <- the optimizer's step <- the helper); the script's
    own step is a training step."""
    import os

    def post_hook():
        return not_a_training_step()

    def step():  # the optimizer's step, which calls its post-hooks
        return post_hook()

    helper = {"step": step}
    code = "def _init_optim_state():\n    return step()\n"
    exec(compile(code, os.path.join("torch", "distributed", "checkpoint", "state_dict.py"), "exec"), helper)
    assert helper["_init_optim_state"]() is True
    assert step() is False


# ------------------------------------------------------------------ training phases
def optimizer_over(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_rival_that_steps_twice_over_unwatched_parameters_starts_a_new_phase():
    old, new = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    phases = Phases()
    phases.watch(old.parameters())
    rival = optimizer_over(new)
    assert phases.watches(optimizer_over(old)) and not phases.watches(rival)
    assert phases.note_rival(rival) is False  # once: could be a second optimizer of the same loop
    assert phases.note_rival(rival) is True and phases.rival is None


def test_a_rival_over_watched_parameters_or_between_the_primarys_steps_is_no_new_phase():
    gen, critic = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    phases = Phases()
    phases.watch([*gen.parameters(), *critic.parameters()])
    watched = optimizer_over(critic)
    assert not any(phases.note_rival(watched) for _ in range(5))  # a GAN's critic
    unwatched = optimizer_over(torch.nn.Linear(2, 2))
    for _ in range(5):
        assert phases.note_rival(unwatched) is False
        phases.primary_stepped()  # the primary steps in between: the old model is still trained
    assert phases.watches(torch.optim.SGD([{"params": []}], lr=0.1))  # nothing to tell by: stays


def test_a_new_phase_retires_the_model_watchers_and_attaches_the_fresh_ones_in_their_places():
    class Watcher(Detector):
        name = "watcher"
        needs_model = True

    class Fault(Detector):
        name = "fault"

    fault, watcher = Fault(), Watcher()
    watcher.cost_ns = 9
    ctx = RankContext(IDENTITY, None, None)
    ctx.end_of_backward.append(watcher.remove_hooks)  # registered by the retired one: dropped
    phases = Phases()
    assert phases.take_attach([fault, watcher]) == [fault, watcher]  # the first phase: every detector
    opt = optimizer_over(torch.nn.Linear(2, 2))
    kept = phases.retire([fault, watcher], ctx, opt)
    assert kept == [fault] and watcher.off and phases.pending and ctx.end_of_backward == []
    assert ctx.optimizers == [opt] and ctx.models == []
    fresh = phases.take_fresh()
    assert len(fresh) == 1 and type(fresh[0]) is Watcher and fresh[0].cost_ns == 9 and not phases.pending
    late = Fault()
    arranged = phases.arrange([*kept, late], fresh)
    assert arranged == [fault, fresh[0], late]
    assert phases.take_attach(arranged) == fresh and phases.take_attach(arranged) == []


# ------------------------------------------------------------------ finding the models
def test_the_finder_notes_the_outermost_forward_and_passes_during_a_replay():
    reexecution, clock, engines = Reexecution(), StepClock(), []
    finder = Finder(reexecution, clock, engines.append)
    model, loss_fn = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.MSELoss()
    finder.install_hooks()
    try:
        with reexecution.replay(1):
            model(torch.ones(1, 2))
        assert finder.roots == [] and clock.t_last is None  # re-executing: nothing seen
        loss_fn(model(torch.ones(1, 2)), torch.zeros(1, 2))
    finally:
        finder.end_hooks(closed=True)
    assert finder.roots == [model] and finder.loss_modules == ["MSELoss"] and clock.t_last is not None
    assert finder.handles == [] and finder.depth == 0 and engines == []
    finder.note_root(model)  # noted once
    assert finder.roots == [model]


def test_the_finder_tells_gradient_all_reduce_from_one_inside_a_forward():
    finder = Finder(Reexecution(), StepClock(), lambda m: None)
    grad, activation, group = torch.ones(2), torch.ones(2), object()
    finder.note_all_reduce(grad)
    finder.depth = 1
    finder.note_all_reduce(activation, group)
    assert finder.reduced_ptrs == {grad.data_ptr(): None} and finder.forward_groups == {group}
    finder.depth, finder.discovering = 0, False
    finder.note_all_reduce(torch.ones(3))  # discovery is over: not noted
    assert len(finder.reduced_ptrs) == 1
    finder.restart()
    assert finder.discovering and finder.reduced_ptrs == {} and finder.forward_groups == set()
    finder.end_hooks(closed=True)


def test_the_finder_describes_what_it_found():
    finder = Finder(Reexecution(), StepClock(), lambda m: None)
    model = torch.nn.Linear(2, 2)
    finder.note_root(model)
    ctx = RankContext(IDENTITY, None, None)
    opt = optimizer_over(model)
    ctx.add_optimizer(opt)
    info = finder.describe(ctx, "optimizer")
    assert info["models"][0]["class"] == "Linear" and info["optimizers"][0]["class"] == "SGD"
    assert info["step_source"] == "optimizer" and ctx.discovery is info and ctx.models == [model]
    assert ctx.layout is not None
    assert {id(p) for p in finder.trained_parameters(ctx)} == {id(p) for p in model.parameters()}
    finder.forget_roots()
    assert finder.roots == []


# ------------------------------------------------------------------ re-execution
def test_reexecution_sets_its_flags_for_the_replay_and_restores_them_on_an_exception():
    r = Reexecution()
    assert (r.replaying, r.replay_step, r.replays, Detector.paused) == (False, None, 0, False)
    with pytest.raises(RuntimeError):
        with r.replay(4):
            assert (r.replaying, r.replay_step, Detector.paused) == (True, 4, True)
            raise RuntimeError("the step raised again")
    assert (r.replaying, r.replay_step, r.replays, Detector.paused) == (False, None, 1, False)
    Detector.paused = True  # a --measure-overhead off block: left as it was
    try:
        with r.replay(5):
            pass
        assert Detector.paused is True and r.replays == 2
    finally:
        Detector.paused = False


# ------------------------------------------------------------------ which call ends a step (runtime.stepsource)
def test_the_first_optimizer_to_step_marks_the_boundary_until_the_script_drops_it():
    from distdebug.runtime import stepsource as ss

    src = ss.StepSource()
    a, b = torch.optim.SGD([torch.zeros(1)], lr=1), torch.optim.SGD([torch.zeros(1)], lr=1)
    assert src.optimizer_stepped(a) == ss.CLAIMED and src.marks(a) and src.kind == ss.OPTIMIZER
    assert src.optimizer_stepped(a) == ss.PRIMARY and src.marks(a)
    assert src.optimizer_stepped(b) == ss.OTHER and not src.marks(b)  # a GAN's second optimizer
    src.follow(b)  # a rival that took over (runtime.phases says when)
    assert src.optimizer_stepped(b) == ss.PRIMARY
    del b  # the script dropped it (held weakly): the next optimizer to step takes over
    assert src.primary is None and src.optimizer_stepped(a) == ss.CLAIMED


def test_an_engine_or_an_explicit_step_marks_the_boundaries_instead_and_explicit_wins():
    from distdebug.runtime import stepsource as ss

    src = ss.StepSource()
    opt = torch.optim.SGD([torch.zeros(1)], lr=1)
    src.engine_found()
    assert src.optimizer_stepped(opt) == ss.ELSEWHERE and not src.marks(opt)  # ZeRO's inner optimizer
    assert not src.scaler_skipped(opt) and src.engine_stepped() and src.kind == ss.DEEPSPEED
    src.explicit()
    src.engine_found()
    assert src.kind == ss.EXPLICIT and not src.engine_stepped()
    scaled = ss.StepSource()
    assert scaled.scaler_skipped(opt) and scaled.kind == ss.OPTIMIZER  # a skipped first step still ends it


# ------------------------------------------------------------------ the detector loop (runtime.dispatch)
class _Counting(Detector):
    name = "counting"

    def __init__(self, raise_in: str = "") -> None:
        self.calls: list[str] = []
        self.raise_in = raise_in

    def _call(self, what: str):
        self.calls.append(what)
        if what == self.raise_in:
            raise ValueError(f"broken {what}")

    def setup(self, ctx):
        self._call("setup")

    def on_step(self, event):
        self._call("on_step")
        return [f"finding of {self.name}"]

    def after_backward(self):
        self._call("after_backward")


class _Quiet(Detector):
    name = "quiet"  # overrides nothing: never called at a step or after a backward


def test_dispatch_calls_only_what_a_detector_has_and_switches_off_one_that_raises():
    from distdebug.runtime.dispatch import Dispatch

    reported, failed = [], []
    good, bad, quiet = _Counting(), _Counting(raise_in="on_step"), _Quiet()
    bad.name = "bad"
    ledger = cost.Ledger()
    d = Dispatch([good, bad, quiet], ledger, reported.append, lambda *a: failed.append(a))
    d.arrange()
    d.set_up(list(d.detectors), None)
    assert good.calls == bad.calls == ["setup"]
    d.step(None)
    assert reported == ["finding of counting"]  # the bad one raised before its finding
    assert [(n, type(e).__name__, where) for n, e, where in failed] == [("bad", "ValueError", "on_step")]
    assert bad.off and d.detectors == [good, quiet]  # off on this rank, said once
    d.after_backward()
    d.step(None)
    assert bad.calls == ["setup", "on_step"] and good.calls == ["setup", "on_step", "after_backward", "on_step"]
    Detector.paused = True  # --measure-overhead's off block: nothing is called
    try:
        d.step(None)
        d.after_backward()
    finally:
        Detector.paused = False
    assert len(good.calls) == 4 and len(failed) == 1
    assert ledger.ns["counting"] > 0  # the time is the detector's, not the session's


# ------------------------------------------------------------------ the session composes them
def test_the_session_keeps_its_names_over_the_rooms():
    from distdebug.runtime.session import Session

    s = Session(IDENTITY, None, [], echo=False)
    assert (s.roots, s.clock.optimizer_steps, s.detectors) == ([], 0, [])
    model = torch.nn.Linear(2, 2)
    s.watch(model)
    assert s.roots == [model]


# ------------------------------------------------------------------ the end of a backward (runtime.localgrads)
def test_the_end_of_backward_calls_run_once_at_the_graphs_end_and_their_hook_goes():
    from distdebug.runtime.localgrads import queue_end_of_backward

    w = torch.ones(2, requires_grad=True)
    seen: list[bool] = []
    calls = [lambda: seen.append(w.grad is not None)]
    loss = (w * 3).sum()
    queue_end_of_backward(loss, calls)
    calls.append(lambda: seen.append(False))  # registered after this backward started: not in it
    loss.backward(retain_graph=True)
    assert seen == [True]  # once, with the gradients accumulated
    loss.backward()
    assert seen == [True]  # its hook removed once it had run
    queue_end_of_backward(torch.ones(()), calls)  # no graph: nothing to watch


def test_a_backward_under_no_sync_queues_only_the_calls_that_want_every_backward():
    # the shared local-gradient norms want the syncing backward only: a micro-batch under no_sync() gets no hook
    # for them (issue 62: one hook and one callback a micro-batch that returned at once); a call that counts
    # every backward (the re-execution's capture) is still queued
    from distdebug.runtime.localgrads import queue_end_of_backward

    w = torch.ones(2, requires_grad=True)
    seen: list[str] = []

    class Syncing:
        syncing_only = True

        def __call__(self) -> None:
            seen.append("norms")

    every = [lambda: seen.append("count")]
    loss = (w * 3).sum()
    queue_end_of_backward(loss, [Syncing()], reduces=False)
    loss.backward(retain_graph=True)
    assert seen == []
    queue_end_of_backward(loss, [Syncing(), *every], reduces=False)
    loss.backward(retain_graph=True)
    assert seen == ["count"]
    queue_end_of_backward(loss, [Syncing(), *every], reduces=True)
    loss.backward()
    assert seen == ["count", "norms", "count"]

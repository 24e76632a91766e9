"""Tier 1 (one process, no ranks): the capture of runtime.rerun: what it records as a step's calls, what it
holds, and which outputs a backward is replayed from. The re-execution across real ranks is tier 2
(tests/dist/test_rerun.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from distdebug.runtime import rerun as rr


def _recorded(model: nn.Module, keep: int = 1) -> rr.Recorder:
    rec = rr.Recorder(model, keep=keep)
    model.register_forward_pre_hook(rec.forward_pre, with_kwargs=True)
    model.register_forward_hook(rec.forward_post, with_kwargs=True)
    for i, p in enumerate(rec.params):
        p.register_hook(rec.param_grad(i))
    return rec


def _step(model: nn.Module, rec: rr.Recorder, step: int, x: torch.Tensor) -> None:
    rec.step = step
    model(x).pow(2).mean().backward()
    rec.backward_done()


def test_a_forward_redirected_on_the_instance_is_not_the_models_call_its_inner_call_is():
    """Lightning's _ForwardRedirection: the module's forward is replaced on the instance by one that puts the
    module's own bound forward back and runs training_step, which calls the model. The outer call is not the
    model's computation (and would be another call later); the inner one is recorded and re-executes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    rec = _recorded(model)
    original = model.forward

    def training_step(x):
        return model(x).pow(2).mean()  # the user's step: calls the model

    def wrapped(x):
        model.forward = original  # Lightning puts the bound forward back on the instance
        return training_step(x)

    model.forward = wrapped
    rec.step = 1
    model(torch.ones(3, 4)).backward()
    rec.backward_done()
    cap = rec.last(1)
    assert cap is not None and len(cap.calls) == 1 and cap.problem is None
    assert cap.calls[0].args[0].shape == (3, 4)
    assert "forward" in vars(model)  # the bound forward stays on the instance, as under Lightning
    assert rr.reexecute(rec, cap).kind == rr.REPRODUCIBLE


def test_evaluation_forwards_are_not_part_of_a_step():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    rec = _recorded(model)
    rec.step = 1
    with torch.no_grad():
        model(torch.ones(2, 4))  # an evaluation between steps
    _step(model, rec, 1, torch.ones(2, 4))
    cap = rec.last(1)
    assert len(cap.calls) == 1 and cap.problem is None
    assert rr.reexecute(rec, cap).kind == rr.REPRODUCIBLE


def test_the_last_steps_are_held_and_their_copies_reused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    rec = _recorded(model, keep=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    copies = []
    for step in range(1, 5):
        _step(model, rec, step, torch.randn(5, 4))
        opt.step()
        opt.zero_grad()
        copies.append(rec.last(step).params[0])
    assert [c.step for c in rec.ring] == [3, 4] and rec.last(2) is None
    assert copies[2] is copies[0] and copies[3] is copies[1]  # no allocation a step once the ring is full
    # parameters and buffers before step 4, inputs and output gradients of its call
    own = sum(t.numel() * t.element_size() for t in [*rec.params, *rec.buffers])
    per_step = own + 5 * 4 * 4 + 5 * 1 * 4
    assert rec.capture_bytes() == 2 * per_step


def test_outputs_computed_from_other_outputs_are_not_replayed_twice():
    """A model that returns its logits and the loss it computed from them: the gradient that reached the
    logits came through the loss; the backward is replayed from the loss alone."""
    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    logits = torch.ones(2, 3) @ w
    loss = logits.logsumexp(1).mean()
    other = (torch.ones(2, 3) @ w).sum()  # an output of its own, not computed from another
    pairs = [(logits, torch.ones_like(logits)), (loss, torch.ones(())), (other, torch.ones(()))]
    kept = rr._roots(pairs)
    assert [t is logits for t, _ in kept] == [False, False] and {id(t) for t, _ in kept} == {id(loss), id(other)}


def test_a_loop_of_forwards_without_a_step_holds_a_bounded_capture_and_a_replay_puts_everything_back():
    """Training-mode forwards with no optimizer step between them (a probe loop): at most MAX_CALLS calls are
    held, then none, and the step is said not to be re-executable (its memory stays flat); the next step is
    captured as ever. A forward-only replay (nan_origin's on-demand watch) of a captured step leaves the
    parameters, buffers and the random generator exactly as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 1))
    rec = rr.Recorder(model, forward_only=True)
    model.register_forward_pre_hook(rec.forward_pre, with_kwargs=True)
    model.register_forward_hook(rec.forward_post, with_kwargs=True)
    x = torch.randn(8, 4)
    rec.step = 1
    for _ in range(rr.MAX_CALLS - 1):
        model(x)
    assert len(rec.current.calls) == rr.MAX_CALLS - 1 and rec.current.problem is None
    for _ in range(rr.MAX_CALLS * 3):
        model(x)
    assert rec.current.calls == [] and "more than 64 forward calls" in rec.current.problem
    assert not rec.current.communicates
    rec.step = 2
    model(x)
    cap = rec.last(2)
    assert len(cap.calls) == 1 and cap.problem is None
    before = ([p.clone() for p in model.parameters()], [b.clone() for b in model.buffers()], torch.get_rng_state())
    seen = []
    handle = model[3].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    rr.replay_forward(rec, cap)
    rr.replay_forward(rec, cap)
    handle.remove()
    assert torch.equal(seen[0], seen[1])  # the same generator state and parameters each time: dropout alike
    assert all(torch.equal(a, b) for a, b in zip(before[0], model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before[1], model.buffers(), strict=True))
    assert torch.equal(before[2], torch.get_rng_state())

"""Re-execution of one training step from a capture: was what happened on this rank reproducible?
(What a step records: ``runtime.capture``.)

Why: when a rank is flagged (its gradient was the first to turn non-finite, its loss spiked), the
next question decides the action: a faulty machine (drain it) or a deterministic cause, a code path or
the data (debug it). Megatron-LM answers it by re-running the iteration inside its own training loop;
here the step is re-run without the user's loop, from what was captured while it ran:

- the inputs of each outermost forward call of the model in the step (the unwrapped module: under DDP
  the module DDP calls, after DDP has synchronised its buffers), detached copies;
- the random generators' states at the start of each call (dropout draws again what it drew);
- the parameters and buffers as they were before the step's first call (copies: the update and
  BatchNorm's running statistics change them afterwards);
- the gradient that arrived at each output tensor of each call: the backward is replayed as
  ``torch.autograd.grad(outputs, parameters, those gradients)``, so the loss function, whatever the
  script does between the model and ``backward()``, is not needed;
- fingerprints (``fingerprint.hashing``, device work, never read here) of each call's outputs and of
  the gradient each parameter received in each backward, before any reduction (a tensor hook on the
  parameter runs before autograd accumulates into ``.grad`` and before DDP's reducer sees it).

``reexecute`` puts the captured parameters and buffers into the live module, restores each call's
generator state, runs the call and its backward again, compares the fingerprints, and puts
everything back as it was, bit for bit (parameters, buffers, generators: the training goes on as if
nothing had happened). Every other hook of the harness passes while it runs (``Detector.paused``,
``Reexecution.replaying``); injected faults do not pause (a persistent fault acts again, as a broken
unit would). The re-execution runs twice: two re-executions that differ from each other mean the
step is not reproducible by itself (non-deterministic kernels), and no verdict is given.

What cannot be re-executed alone, and is said: a forward that communicates (SyncBatchNorm, tensor
parallelism, FSDP's all-gathers: a re-execution on one rank would wait for peers that are not
re-executing), several forward calls feeding one backward (their gradients cannot be told apart),
DeepSpeed engines (the engine owns the backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from distdebug.runtime.capture import (  # re-exported: what a step records is read through this module too
    MAX_CALLS,
    Call,
    Capture,
    Recorder,
    autocast,
    detach_copy,
    fingerprint,
    output_tensors,
    rng_state,
    set_rng,
)

__all__ = ["CANNOT", "MAX_CALLS", "NONDETERMINISTIC", "NOT_REPRODUCIBLE", "REPRODUCIBLE", "Call", "Capture",
           "Recorder", "Verdict", "output_tensors", "reexecute", "replay_forward"]

REPRODUCIBLE = "reproducible"
NOT_REPRODUCIBLE = "not reproducible"
NONDETERMINISTIC = "nondeterministic"
CANNOT = "cannot re-execute"


@dataclass
class Verdict:
    kind: str
    step: int
    differs: list[str] = field(default_factory=list)
    """What differed between the first execution and the re-execution, first one first."""
    reason: str = ""


@contextlib.contextmanager
def _swapped(rec: Recorder, cap: Capture) -> Iterator[None]:
    """The live module with the captured parameters and buffers, then exactly its own again."""
    with torch.no_grad():
        saved_p = [p.detach().clone() for p in rec.params]
        saved_b = [b.detach().clone() for b in rec.buffers]
        rng = rng_state(rec.device)
        for p, c in zip(rec.params, cap.params, strict=True):
            p.copy_(c)
        for b, c in zip(rec.buffers, cap.buffers, strict=True):
            b.copy_(c)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(rec.params, saved_p, strict=True):
                p.copy_(s)
            for b, s in zip(rec.buffers, saved_b, strict=True):
                b.copy_(s)
        set_rng(rng, rec.device)


def replay_forward(rec: Recorder, cap: Capture) -> None:
    """Run the step's forward calls again, as captured (parameters, buffers, generator states, autocast),
    then put everything back bit for bit; what the caller's hooks saw is the result (nan_origin's on-demand
    localisation: its module hooks are on for the length of the call). Gradients on, as in training (the
    graph is dropped at once); nothing is compared here."""
    rec.replaying = True
    try:
        with _swapped(rec, cap):
            for call in cap.calls:
                _call_again(rec, call)
    finally:
        rec.replaying = False


def _call_again(rec: Recorder, call: Call) -> Any:
    """One captured call run as it ran: its generator state and autocast restored, fresh copies of its inputs,
    gradients on; its output."""
    set_rng(call.rng, rec.device)
    with autocast(call.autocast), torch.enable_grad():
        return rec.module(*detach_copy(call.args), **detach_copy(call.kwargs))


def _run(rec: Recorder, cap: Capture) -> list[tuple[list[Any] | None, dict[int, Any]]]:
    """One re-execution of every call of the step: (output sums, {parameter index: gradient sums}) per call."""
    results = []
    for call in cap.calls:
        outs = output_tensors(_call_again(rec, call))
        out_fp = fingerprint([o.detach() for o in outs]) if outs else None
        pairs = [(o, g) for o, g in zip(outs, call.out_grads, strict=False) if g is not None and o.requires_grad]
        pairs = _roots(pairs)
        grads: dict[int, Any] = {}
        wanted = sorted(call.grad_fps)
        if pairs and wanted:
            got = torch.autograd.grad([o for o, _ in pairs], [rec.params[i] for i in wanted],
                                      grad_outputs=[g for _, g in pairs], allow_unused=True)
            present = [(i, g) for i, g in zip(wanted, got, strict=True) if g is not None]
            grads = dict(zip([i for i, _ in present], fingerprint([g for _, g in present]), strict=True))
        results.append((out_fp, grads))
    return results


def _roots(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The outputs the backward is replayed from: not those another output was computed from. A model that
    computes its loss in its forward (Hugging Face's, given labels) returns the logits and the loss; the
    gradient that reached the logits came through the loss, and replaying it as well would count it twice.
    A walk of the re-executed graph (the rare path), bounded by its size."""
    if len(pairs) < 2:
        return pairs
    nodes = {o.grad_fn: i for i, (o, _) in enumerate(pairs) if o.grad_fn is not None}
    inner: set[int] = set()
    for j, (o, _) in enumerate(pairs):
        if o.grad_fn is None:
            continue
        seen: set[Any] = set()
        stack = [fn for fn, _ in o.grad_fn.next_functions if fn is not None]
        while stack and len(seen) < 1_000_000:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            i = nodes.get(fn)
            if i is not None and i != j:
                inner.add(i)
            stack.extend(f for f, _ in fn.next_functions if f is not None)
    return [p for i, p in enumerate(pairs) if i not in inner]


def _differences(rec: Recorder, cap: Capture, a: list, b: list | None = None) -> list[str]:
    """What differs between two executions (b None: the first one, as captured), first one first. Host
    fingerprints are compared as they are; device ones on their device, read in one transfer per device
    (the rare path: a flagged step)."""
    verdicts: list[tuple[str, Any]] = []  # (label, True/False or a device bool)
    for k, call in enumerate(cap.calls):
        fp_a, grads_a = a[k]
        fp_b, grads_b = (call.out_fp, call.grad_fps) if b is None else b[k]
        where = f" (forward call {k + 1} of the step)" if len(cap.calls) > 1 else ""
        outs_a, outs_b = fp_a or [], fp_b or []
        pairs = [(f"the model's output{where}", x, y) for x, y in zip(outs_a, outs_b, strict=False)]
        if len(outs_a) != len(outs_b):
            verdicts.append((f"the model's output{where}", False))
        pairs += [(f"the local gradient of {rec.param_names[i]}{where}", grads_a.get(i), grads_b.get(i))
                  for i in sorted(set(grads_a) | set(grads_b))]
        for label, x, y in pairs:
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                verdicts.append((label, (x == y.to(x.device)).all()))
            else:
                verdicts.append((label, x is not None and x == y))
    lazy: dict[Any, list[int]] = {}
    for i, (_, v) in enumerate(verdicts):
        if isinstance(v, torch.Tensor):
            lazy.setdefault(v.device, []).append(i)
    same = [v if not isinstance(v, torch.Tensor) else None for _, v in verdicts]
    for idx in lazy.values():
        for i, ok in zip(idx, torch.stack([verdicts[i][1] for i in idx]).tolist(), strict=True):  # one read
            same[i] = ok
    seen: set[str] = set()
    out = []
    for (label, _), ok in zip(verdicts, same, strict=True):
        if not ok and label not in seen:
            seen.add(label)
            out.append(label)
    return out


def reexecute(rec: Recorder, cap: Capture, around: Any = contextlib.nullcontext) -> Verdict:
    """Re-execute ``cap``'s step twice on ``rec``'s module and compare (see the module docstring). ``around()``:
    a context each re-execution runs in (the session's ``replay``: the harness's hooks pass)."""
    if cap.problem:
        return Verdict(CANNOT, cap.step, reason=cap.problem)
    if not cap.calls:
        return Verdict(CANNOT, cap.step, reason="no forward call of the model was captured in this step")
    rec.replaying = True
    try:
        with around(), _swapped(rec, cap):
            first = _run(rec, cap)
        with around(), _swapped(rec, cap):
            second = _run(rec, cap)
    finally:
        rec.replaying = False
    if _differences(rec, cap, first, second):
        return Verdict(NONDETERMINISTIC, cap.step, reason="two re-executions of the step differ from each other: "
                       "it runs non-deterministic kernels, so a difference from the first execution proves nothing")
    differs = _differences(rec, cap, first)
    return Verdict(NOT_REPRODUCIBLE if differs else REPRODUCIBLE, cap.step, differs=differs)

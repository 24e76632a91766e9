"""What a training step records so that it can be re-executed on this rank (``runtime.rerun`` re-executes it).

While a step runs, ``Recorder``'s forward hooks keep, for each outermost forward call of the model, detached
copies of its inputs, the random generators' and autocast's states as it started, the parameters and buffers
as they were before the step's first call, the gradient that arrived at each output and fingerprints (device
work, never read here) of the outputs and of each parameter's gradient before any reduction. Bounded: at
most ``MAX_CALLS`` calls a step and the last ``keep`` steps. Why each piece is kept: ``runtime.rerun``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from distdebug import envvars
from distdebug.fingerprint.hashing import device_sums, fast_cpu_fingerprint
from distdebug.fingerprint.hostpass import DATA_PTR, HostCopy, flat_clones

MAX_CALLS = 64
"""Forward calls of the model held for one step at most (bounded memory whatever the loop does)."""

def output_tensors(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a forward's output (nested tuples, lists, dicts, ModelOutput), depth first."""
    found: list[torch.Tensor] = []

    def walk(x: Any, depth: int) -> None:
        if depth > 6 or len(found) >= 64:
            return
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, depth + 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, depth + 1)

    walk(out, 0)
    return found


def fingerprint(tensors: list[torch.Tensor]) -> list[Any]:
    """One fingerprint per tensor, never read here: a CPU tensor's is xxh3 of its bytes on the host (an int, at
    memory speed); a device tensor's its two sums where it lives (a small int64 tensor, read only when a step
    is compared). ``DISTDEBUG_DEVICE_PATH=1`` sends CPU tensors down the device path too (the tests)."""
    forced = envvars.device_path_forced()
    out: list[Any] = [None] * len(tensors)
    by_device: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.device.type == "cpu" and not forced:
            out[i] = fast_cpu_fingerprint(t)
        else:
            by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        rows = device_sums([tensors[i] for i in idx])
        for k, i in enumerate(idx):
            out[i] = rows[k]
    return out


def own_forward(module: Any) -> bool:
    """The call runs the module's own forward: none set on the instance, or its class's, bound to it."""
    f = vars(module).get("forward")
    return f is None or (getattr(f, "__func__", None) is type(module).forward
                         and getattr(f, "__self__", None) is module)


def detach_copy(x: Any, depth: int = 0) -> Any:
    """A copy of a call's inputs that the training cannot change afterwards (tensors detached and cloned)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if depth > 6:
        return x
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(detach_copy(v, depth + 1) for v in x)
    if isinstance(x, list):
        return [detach_copy(v, depth + 1) for v in x]
    if type(x) is dict:
        return {k: detach_copy(v, depth + 1) for k, v in x.items()}
    return x


def rng_state(device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = None
    if device is not None and device.type == "cuda":
        cuda = torch.cuda.get_rng_state(device)
    return torch.get_rng_state(), cuda


def autocast_state(device: torch.device | None) -> tuple[tuple[str, bool, Any], ...]:
    """Autocast as a call starts, on the CPU and on the parameters' device (AMP: the replay computes in the
    same precision)."""
    types = ["cpu"] + ([device.type] if device is not None and device.type != "cpu" else [])
    out = []
    for dt in types:
        try:
            out.append((dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)))
        except Exception:  # a device type without autocast
            pass
    return tuple(out)


def autocast(state: tuple[tuple[str, bool, Any], ...]) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for dt, enabled, dtype in state:
        stack.enter_context(torch.autocast(dt, dtype=dtype, enabled=enabled))
    return stack


def set_rng(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device | None) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None and device is not None:
        torch.cuda.set_rng_state(state[1], device)


@dataclass
class Call:
    """One outermost forward call of the step and what its backward did."""

    args: Any
    kwargs: Any
    rng: tuple[torch.Tensor, torch.Tensor | None]
    autocast: tuple[tuple[str, bool, Any], ...] = ()  # (device type, enabled, dtype) as the call ran
    out_fp: list[Any] | None = None  # a fingerprint per output tensor (fingerprint())
    out_grads: list[torch.Tensor | None] = field(default_factory=list)
    grad_fps: dict[int, Any] = field(default_factory=dict)  # parameter index -> its gradient's fingerprint


@dataclass
class Capture:
    """What one step needs to be re-executed on this rank."""

    step: int
    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    calls: list[Call] = field(default_factory=list)
    problem: str | None = None
    """Why this step cannot be re-executed (None: it can)."""
    overflowed: bool = False  # more than MAX_CALLS calls: none held from then on
    communicates: bool = False
    """The forward ran a collective (or SyncBatchNorm): no step of this model can be re-executed alone."""
    backward_calls: int = 0


class Recorder:
    """Captures each step of one module (see the module docstring). Device work only in its hooks."""

    def __init__(self, module: torch.nn.Module, keep: int = 1, collectives: Any = None,
                 step_of: Any = None, forward_only: bool = False) -> None:
        """``keep``: the last steps whose captures are held (a flag that comes a step or two late still finds
        its step); ``collectives``: a callable giving the rank's count of collectives so far (the session's),
        to see a forward that communicates; ``step_of``: a callable giving the step in progress (else ``step``,
        set by the caller at each boundary); ``forward_only``: what ``replay_forward`` needs and nothing more
        (inputs, generator states, parameters and buffers: no output gradients, no fingerprints; nan_origin's
        on-demand localisation), so that the capture can stay on."""
        self.module = module
        self.forward_only = forward_only
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.param_names = [n for n, _ in named]
        self.buffers = [b for _, b in module.named_buffers()]
        self.device = self.params[0].device if self.params else None
        self.current: Capture | None = None
        self.ring: list[Capture] = []  # the last ``keep`` captures, oldest first
        self.keep = max(1, keep)
        self.collectives = collectives
        self.step_of = step_of
        self._seq = 0
        self.sharded = any(type(p) is not torch.nn.Parameter and type(p) is not torch.Tensor for p in self.params)
        self.step = 1  # the step being captured (the session's last boundary + 1; set by the detector)
        self._stack: list[bool] = []  # per open call of the module: recorded or not
        self.communicates = any(type(m).__name__ == "SyncBatchNorm" for m in module.modules())
        self.replaying = False  # re-executing: its own hooks pass
        self._detached_params, self._detached_buffers = _Detached(), _Detached()

    # ------------------------------------------------------------------ hooks (installed by the detector)
    def forward_pre(self, module: Any, args: Any, kwargs: Any) -> None:
        if self.replaying:
            return
        # Outermost calls with gradients on only: an evaluation forward (no_grad) is no part of a step's
        # computation; a nested call of the same module is part of the outer one. A call through a forward
        # replaced on the instance (Lightning runs training_step as the DDP-wrapped module's forward for the
        # length of the call, then puts the module's own bound forward back on the instance) is not the
        # model's computation and would not be the same call later: the model's own forward, called inside
        # it, is recorded instead.
        record = not any(self._stack) and torch.is_grad_enabled() and own_forward(module)
        cap = self._open() if record else None
        if cap is not None and (cap.overflowed or len(cap.calls) >= MAX_CALLS):
            # A loop of training-mode forwards without a step (a probe of activations, a long accumulation):
            # what is held stays bounded; the step is not re-executed (said), the calls held are let go.
            cap.problem = cap.problem or (f"more than {MAX_CALLS} forward calls with gradients on in one step: not "
                                          "held (a loop of forwards between two optimizer steps)")
            cap.calls.clear()
            cap.overflowed = True
            record = False
        self._stack.append(record)
        if cap is None or not record:
            return
        if len(cap.calls) > cap.backward_calls and not self.forward_only:
            cap.problem = cap.problem or ("a forward call without a backward of its own in the step (several calls "
                                          "feeding one backward): their gradients cannot be told apart")
        cap.calls.append(Call(detach_copy(args), detach_copy(kwargs), rng_state(self.device),
                              autocast_state(self.device)))
        self._seq = self.collectives() if self.collectives is not None else 0

    def forward_post(self, module: Any, args: Any, kwargs: Any, out: Any) -> None:
        if self.replaying or not self._stack:
            return
        if not self._stack.pop() or self.current is None or not self.current.calls:
            return
        call = self.current.calls[-1]
        if self.collectives is not None and self.collectives() != self._seq:
            self.current.communicates = True
            self.current.problem = self.current.problem or (
                "the model's forward communicates (a collective inside it: tensor parallelism or layers synchronised "
                "by hand): one rank cannot re-run it alone")
        if self.forward_only:
            return
        outs = output_tensors(out)
        call.out_fp = fingerprint([o.detach() for o in outs]) if outs else None
        call.out_grads = [None] * len(outs)
        for i, o in enumerate(outs):
            if o.requires_grad:
                o.register_hook(self._out_grad(call, i))

    def _out_grad(self, call: Call, i: int) -> Any:
        def hook(g: torch.Tensor) -> None:
            call.out_grads[i] = g.detach().clone()

        return hook

    def param_grad(self, index: int) -> Any:
        def hook(g: torch.Tensor) -> None:
            cap = self.current
            if self.replaying or cap is None or not cap.calls or torch.compiler.is_compiling():
                return
            call = cap.calls[-1]
            if index in call.grad_fps:  # a second backward through the same call (retain_graph): not replayable
                cap.problem = cap.problem or "a forward call with more than one backward through it"
                return
            call.grad_fps[index] = fingerprint([g.detach()])[0]

        return hook

    def backward_done(self) -> None:
        if self.current is not None:
            self.current.backward_calls += 1

    def _open(self) -> Capture:
        """The step's capture, made at its first forward call: the parameters and buffers before it."""
        if self.step_of is not None:
            self.step = self.step_of()
        if self.current is not None and self.current.step == self.step:
            return self.current
        # The oldest capture beyond ``keep`` lends its copies (no allocation a step once the ring is full).
        spare = self.ring.pop(0) if len(self.ring) >= self.keep else None
        with torch.no_grad():
            if spare is not None and len(spare.params) == len(self.params) and len(spare.buffers) == len(self.buffers):
                # one fused copy each (a Python loop of copy_ cost three times as much on a 52-tensor model)
                copy_all(spare.params, self.params, self._detached_params, owned=True)
                copy_all(spare.buffers, self.buffers, self._detached_buffers, owned=True)
                params, buffers = spare.params, spare.buffers
            else:
                params = flat_clones(self.params)  # end to end: the next steps copy into them in one call
                buffers = flat_clones(self.buffers)
        self.current = Capture(self.step, params, buffers)
        self.ring.append(self.current)
        if self.communicates:
            self.current.communicates = True
            self.current.problem = "the model's forward communicates (SyncBatchNorm): one rank cannot re-run it alone"
        elif self.sharded:
            self.current.problem = ("the parameters are sharded (FSDP2, tensor parallelism): the forward gathers them "
                                    "from the other ranks, so one rank cannot re-run it alone")
        return self.current

    def last(self, step: int) -> Capture | None:
        """The capture of ``step`` while it is held (the last ``keep`` steps)."""
        return next((c for c in self.ring if c.step == step), None)

    def capture_bytes(self) -> int:
        """What the held captures occupy: parameter and buffer copies, inputs, output gradients."""
        total = 0
        for cap in self.ring:
            tensors = [*cap.params, *cap.buffers]
            for call in cap.calls:
                tensors += [t for t in tensors_in(call.args) + tensors_in(call.kwargs)] + [g for g in call.out_grads
                                                                                      if g is not None]
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total


class _Detached:
    """The detached views of a list of tensors, kept while they keep their storage (a view shares it): one
    detach a tensor a step was 0.5 us, a third of the capture's cost on a 1,000-tensor model (issue 62). On a CPU
    the copy itself is made on the host (``HostCopy``: a memmove a tensor, not a dispatched kernel)."""

    def __init__(self) -> None:
        self.ptrs: list[int] = []
        self.views: list[torch.Tensor] = []
        self.host = HostCopy()

    def of(self, src: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        try:
            ptrs = list(map(DATA_PTR, src))
        except Exception:  # a tensor without storage: detached afresh
            return [t.detach() for t in src]
        if ptrs != self.ptrs or len(self.views) != len(src):
            self.ptrs, self.views = ptrs, [t.detach() for t in src]
        return self.views


def copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], detached: _Detached | None = None,
             owned: bool = False) -> None:
    """``owned``: ``dst`` is a capture's own list of its own copies, never changed (``HostCopy.copy``)."""
    if not dst:
        return
    if detached is not None and not envvars.device_path_forced() and detached.host.copy(
            dst if owned and isinstance(dst, list) else list(dst), list(src), owned=owned and isinstance(dst, list)):
        return
    try:
        torch._foreach_copy_(list(dst), detached.of(src) if detached is not None else [t.detach() for t in src])
    except Exception:  # a mix the fused copy does not take (devices, dtypes): one at a time
        for d, t in zip(dst, src, strict=True):
            d.copy_(t)


def tensors_in(x: Any, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if depth > 6:
        return []
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
    return [t for v in items for t in tensors_in(v, depth + 1)]

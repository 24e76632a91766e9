"""Memory: where each rank's bytes go (parameters, gradients, optimizer state, activations, other), per
step and at the peak, against the static estimate, so that "OOM in forward means activations" (a
practitioners' rule) is a reading, not a guess.

- Parameters, gradients and optimizer state: the bytes of the tensors this rank holds (a DTensor's
  local shard), each storage counted once, read at the step boundary (after the optimizer step,
  before the next zero_grad). Their sizes only change in the first steps (Adam creates its state at
  its first step), so they are read at steps 1, 2, 4, 8, 16, ... (``read_step``), not every step.
- Activations: the bytes autograd saved for backward, read from the graph itself when the checked
  step's first backward starts (each storage once, parameters left out): the step's activation
  peak. Read-only: the autograd graph is walked from the loss and each node's saved tensors are
  looked at, nothing is installed. (A saved-tensors hook would see them as they are saved, but a
  pack hook that hands a saved *output* back makes a reference cycle through C++ that Python
  cannot collect: every training-mode forward without a backward, e.g. an evaluation without
  no_grad, then leaked its whole graph; and a hook that detaches instead changes what double
  backward and autograd's in-place checks see.) Forwards that never reach a backward are not
  training and are not counted.
- Other: on GPU, what the CUDA caching allocator holds beyond the four (temporaries, workspace,
  fragmentation), from ``torch.cuda.memory_allocated``; the peak from ``max_memory_allocated``.
  On CPU there is no allocator to ask: "other" is not measured.

Each read step (2, 4, 8, 16, ... doubling to 1,024, then every 1,024: ``read_step``) writes a ``memory``
record; the end writes the largest of them as the peak. The static estimate for one
dtype is parameters : gradients : optimizer state = 1 : 1 : k, with k = 2 for Adam and AdamW, 1 for
SGD with momentum, 0 without; a category more than OUTGROW times its estimate gets an info finding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from distdebug.artifacts import schema
from distdebug.cards.memory import CARD
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity

OUTGROW = 1.5
READ_EVERY = 1024
"""Past the doubling steps, the steps read every READ_EVERY (``read_step``)."""


def read_step(step: int) -> bool:
    """The steps whose memory is read: 2, 4, 8, 16, ... doubling to READ_EVERY, then every READ_EVERY. A read walks
    every parameter and, at the step's first backward, the autograd graph: 20 to 60 ms on a 1,000-module model on a
    CPU, which every 16 steps was 1 to 4 ms a step of the steady cost (issue 62). The breakdown is the same from one
    step to the next in a steady loop; a change of batch shape or model is still read within READ_EVERY steps."""
    return step >= 2 and (step & (step - 1) == 0 or step % READ_EVERY == 0)


def optimizer_factor(opt: Any) -> float:
    """State bytes per parameter byte a plain optimizer of this class keeps (the static estimate)."""
    name = type(opt).__name__
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adafactor"):
        return 2.0
    if name == "SGD":
        return 1.0 if any(g.get("momentum", 0) for g in getattr(opt, "param_groups", [])) else 0.0
    if name in ("RMSprop", "Adagrad", "Adadelta"):
        return 1.0
    return 2.0


def _bytes(tensors: Iterable[Any], seen: set[int]) -> int:
    from distdebug.fingerprint.hashing import local_view

    total = 0
    for t in tensors:
        if t is None:
            continue
        try:
            t = local_view(t)
            if not t.numel():
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # a storage that was freed (FSDP2's unsharded parameters): holds no bytes
            continue
        if key not in seen:
            seen.add(key)
            total += nbytes
    return total


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}
"""An autograd node type's ``_saved_*`` attributes (the same for every node of the type; a few hundred types)."""


def saved_bytes(tensors: Any, skip: set[int]) -> int:
    """Bytes of the tensors autograd saved in the graph behind ``tensors`` (what backward will run on),
    each storage once, storages in ``skip`` (the parameters) left out. Read-only: each node's
    ``_saved_*`` attributes, as autograd exposes them; nodes whose saved values were freed are skipped."""
    import torch

    roots = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
    stack: list[Any] = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    nodes: set[int] = set()
    storages: set[int] = set()
    total = 0
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in nodes:
            continue
        nodes.add(id(fn))
        names = _SAVED_NAMES.get(type(fn))
        if names is None:  # dir() of every node cost 3 ms a check on a 100-module model (issue 18): once a type
            names = _SAVED_NAMES[type(fn)] = tuple(n for n in dir(fn) if n.startswith("_saved_"))
        for name in names:
            try:
                value = getattr(fn, name)
            except Exception:  # freed already (retain_graph=False earlier), or not a tensor attribute
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.numel():
                    try:
                        storage = t.untyped_storage()
                        key = storage.data_ptr()
                    except Exception:  # no storage (a fake or nested tensor): not counted
                        continue
                    if key not in skip and key not in storages:
                        storages.add(key)
                        total += storage.nbytes()
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return total


def breakdown(params: list[Any], optimizers: list[Any]) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds (pure over live tensors)."""
    import torch

    seen: set[int] = set()
    p_bytes = _bytes(params, seen)
    g_bytes = _bytes((p.grad for p in params), seen)
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"parameters": p_bytes, "gradients": g_bytes, "optimizer_state": _bytes(state, seen)}


class Memory(Detector):
    name = "memory"
    needs_model = True
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    def __init__(self) -> None:
        self.ctx: RankContext | None = None
        self.params: list[Any] = []
        self.param_keys: set[int] = set()
        self.activations = 0
        self.static: dict[str, int] = {}
        self.peak: dict[str, Any] = {"total": -1}
        self.armed = False  # the coming step is checked: its first backward reads the graph
        self.hookable = False
        self.cuda = False
        self.reported: set[str] = set()

    def attach(self, ctx: RankContext) -> None:

        from distdebug.runtime.discovery import unwrap

        self.ctx = ctx
        # The model's parameters and every one its optimizers update (each storage is counted once):
        # under DDP x TP the TP parameters leave the module's parameters() after DDP's first forward, and
        # counting the optimizer's state for them against parameters not counted made it look 18x too big.
        self.params = [p for root in ctx.models for p in unwrap(root)[0].parameters()]
        self.params += [p for opt in ctx.optimizers for g in getattr(opt, "param_groups", []) for p in g["params"]]
        from distdebug.fingerprint.hashing import local_view

        self.param_keys = set()
        for p in self.params:
            try:  # a DTensor's local shard; storages FSDP2 freed or never had cannot be asked
                t = local_view(p)
                if t.numel():
                    self.param_keys.add(t.untyped_storage().data_ptr())
            except RuntimeError:
                pass
        self.cuda = any(p.is_cuda for p in self.params)
        # torch.compile'd models are left alone: a saved-tensors hook would change how they compile.
        self.hookable = not any("torch.compile" in unwrap(root)[1] for root in ctx.models)
        if self.hookable:
            import torch

            self.patch(ctx, torch.autograd, "backward", self._wrap_backward)
        self._read(0)
        self.armed = read_step(2)

    def _wrap_backward(self, original: Any) -> Any:
        det = self

        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if det.armed:
                det.armed = False  # the step's first backward: its graph holds the step's activations
                try:
                    det.activations = saved_bytes(tensors, det.param_keys)
                except Exception:  # a graph that cannot be read is not counted; backward goes on
                    det.activations = 0
            return original(tensors, *args, **kwargs)

        return backward

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        # The step's saved tensors were counted at its first backward, before backward freed them.
        act = self.activations
        self.activations = 0
        if self.ctx is None:
            return ()
        if read_step(event.step) or event.step == 1:
            self._read(event.step, act)
        self.armed = read_step(event.step + 1)
        return self._verdicts(event.step)

    def _read(self, step: int, activations: int = 0) -> None:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        import torch

        self.static = breakdown(self.params, ctx.optimizers)
        row: dict[str, Any] = {**self.static, "activations": activations}
        if self.cuda:
            allocated = torch.cuda.memory_allocated()
            row["other"] = max(0, allocated - sum(row.values()))
            row["allocator_peak"] = torch.cuda.max_memory_allocated()
        self._track_peak(step, row)
        if step:
            ctx.emit(schema.MEMORY, step=step, **row, total=sum(v for k, v in row.items() if k != "allocator_peak"))

    def _track_peak(self, step: int, row: dict[str, Any]) -> None:
        total = sum(v for k, v in row.items() if k != "allocator_peak")
        if total > self.peak["total"]:
            self.peak = {"step": step, **row, "total": total}

    def _verdicts(self, step: int) -> list[Finding]:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        params = self.static.get("parameters", 0)
        if not params or not ctx.optimizers or step < 2:
            return []
        out = []
        k = optimizer_factor(ctx.optimizers[0])
        for cat, factor in (("gradients", 1.0), ("optimizer_state", k)):
            have = self.static.get(cat, 0)
            if factor and have > OUTGROW * factor * params and cat not in self.reported:
                self.reported.add(cat)
                out.append(Finding(
                    severity=Severity.INFO, detector=self.name, ranks=[ctx.rank], step=step, subject=cat,
                    message=f"{cat.replace('_', ' ')} hold {have / params:.1f}x the parameters' bytes; the static "
                            f"estimate for {type(ctx.optimizers[0]).__name__} is {factor:g}x "
                            f"(parameters {params} B, {cat} {have} B)",
                    evidence={"parameters": params, cat: have, "estimate_factor": factor},
                    fix="fp32 master copies or extra buffers (mixed precision, EMA), gradients kept in another "
                        "dtype, or state not sharded (ZeRO/FSDP shard optimizer state)",
                ))
        return out

    def on_end(self) -> Iterable[Finding]:
        self.armed = False
        if self.ctx is not None and self.peak.get("total", -1) >= 0:
            self.ctx.emit(schema.MEMORY_PEAK, **self.peak)
        return ()

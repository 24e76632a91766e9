"""NanOrigin: where the first NaN/Inf came from: the step, the rank it started on, the first parameter
(backward order) whose gradient was non-finite and the first module (forward order) whose output was.

Why it needs more than the loss: an all-reduce spreads one rank's NaN gradient to every rank in the
same step, so after the step every rank looks guilty. What tells them apart is each rank's *local*
gradient before the reduction:

- DDP: with its default ``gradient_as_bucket_view=False`` the reducer reduces copies of the
  gradients in its buckets and copies the results back into ``.grad`` when it finalises, at the end
  of the backward; a callback queued when the backward starts (``ctx.end_of_backward``) runs before
  that and reads every local gradient at once (one fused reduction on a device, no host sync).
  With ``gradient_as_bucket_view=True`` the gradients are the buckets, reduced in place as each is
  ready: there a hook on each parameter (``register_post_accumulate_grad_hook``) sees its local
  gradient once autograd has accumulated it, before the reducer does. DDP's reduction is never
  touched (its own path, or the script's communication hook whenever registered): bitwise the same
  by construction. Both go in before the model's first backward, so a NaN in step 1 has its origin too.
- Hand-written all_reduce: the input of each ``all_reduce`` is checked before the call (named by
  the parameter whose ``.grad`` it is, or as a flattened buffer).
- Modules: forward hooks on leaf modules and modules with parameters record whether each output
  was finite (one reduction per module, no host sync). Modules whose output is finite whenever
  their input and parameters are (activations, pooling, dropout; embeddings and normalisations
  where the parameters are checked whole) get none: the model's input is checked instead.
  On-demand watch (``config.watch``, the default where one rank can re-execute its forward alone):
  these hooks are on only while the step found non-finite is re-executed from a forward-only
  capture (runtime.rerun: the step's inputs, generator and autocast states, one copy of the
  parameters and buffers), so a healthy step pays for the capture, not for a reduction and a hooked
  call per module; full watch keeps them on in every step (FSDP2, DeepSpeed, TP, pipelines,
  SyncBatchNorm, a forward that communicates, a compiled model, several models; or when asked).
  The DDP local gradients' norms are shared with loss_spike (runtime.localgrads).

All flags are device tensors; at the step boundary one fused check over them and over the
parameters after the step (a non-finite gradient reaches its parameter through the update) is one
device scalar, read with the harness's
other values in the step's single host read (runtime.readout). Only when it fails are the flags
read one by one (the rare path). The module hooks come in at the end of step 1 (discovery), so a
NaN in step 1 is found by its step and local gradients (DDP), not by its module.

FSDP2 and DeepSpeed reduce gradients inside the framework: there the finding names the step and
the module, and says that the origin rank could not be told.

AMP: a step that a loss scaler (``torch.amp.GradScaler``, DeepSpeed fp16) skipped because its scaled
gradients overflowed is not a finding when the forward's outputs and the loss were finite (that
is the scaler doing its job; ``loss_scale`` records it). A non-finite forward output or loss is
found as ever, with its origin rank, skipped step or not.

``--stop-on-nan``: after the finding is written, the rank ends with EXIT_NAN (every rank sees the
NaN in the same step once it has been reduced).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from distdebug.config import EXIT_NAN, NanOriginConfig
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.fingerprint.hashing import local_view
from distdebug.runtime.callsite import user_line
from distdebug.runtime.discovery import ddp_params, find_ddp, first_tensor, runs_compiled, unwrap
from distdebug.runtime.localgrads import local_grad_norms

INF = float("inf")
strided = torch.strided

FINITE_PRESERVING_NAMES = frozenset({
    "ReLU", "ReLU6", "LeakyReLU", "PReLU", "Hardtanh", "Sigmoid", "Tanh", "Hardsigmoid", "Hardswish",
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "Identity", "Flatten", "Unflatten",
    "MaxPool1d", "MaxPool2d", "MaxPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
    "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
    "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d", "ConstantPad3d",
    "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d", "ReplicationPad1d", "ReplicationPad2d",
    "ReplicationPad3d", "CircularPad1d", "CircularPad2d", "CircularPad3d",
    # bounded by |x| or by a constant, also in fp16/bf16: GELU, SiLU, Mish, ELU, CELU, the shrinks, Softsign,
    # GLU; Softmax and its kin subtract the maximum first; LogSigmoid is computed stably. Not SELU (its scale
    # 1.05 overflows fp16 near its maximum), Softplus (exp before its threshold), LPPool (powers).
    "GELU", "SiLU", "Mish", "ELU", "CELU", "Hardshrink", "Softshrink", "Tanhshrink", "Softsign", "GLU",
    "Softmax", "Softmin", "LogSoftmax", "Softmax2d", "LogSigmoid",
    "PixelShuffle", "PixelUnshuffle", "ChannelShuffle", "Upsample", "UpsamplingNearest2d",
    "UpsamplingBilinear2d", "FractionalMaxPool2d", "FractionalMaxPool3d",
})
"""torch.nn's parameterless modules whose output is finite whenever their input is: never the *first*
module with a non-finite output (the module before them would be), so they get no hook; every hook
costs time in every forward. Exact classes only: a subclass may compute anything."""



FINITE_GIVEN_PARAMETERS_NAMES = frozenset({
    "Embedding", "LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm",
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
})
"""torch.nn's modules whose output is finite whenever their input and their parameters are: an embedding
picks rows of its weight; a normalisation subtracts the mean and divides by sqrt(var + eps) (fp16/bf16 in
fp32), then scales and shifts. Their parameters are checked every step (the probe) and their input is
the output of the module before (or the model's input, checked too), so where they are not sharded by a
framework they need no hook either: on a transformer, a third of the activations summed every step."""


def finite_preserving(mod: torch.nn.Module) -> bool:
    """Finite output from finite input and parameters (exact torch.nn classes: a subclass may compute anything)."""
    cls = type(mod)
    return cls.__module__.startswith("torch.nn.modules.") and (
        cls.__name__ in FINITE_PRESERVING_NAMES or cls.__name__ in FINITE_GIVEN_PARAMETERS_NAMES)


MAX_KEYS = 4096
"""Distinct keys a per-step record keeps (modules, gradient buckets); more fold into one."""


def _finite_norm(t: torch.Tensor) -> float:
    """The norm whose finiteness says whether every value is finite, the cheapest where ``t`` lives. The
    inf-norm (max |x|) cannot overflow, and is what a GPU's fused kernel does fast; torch's CPU inf-norm
    runs at about 1.2 GB/s here, its 2-norm (squares summed in double on the CPU) about 30 times faster,
    and it overflows only past 1e35 (the sqrt back to float32): a finite-or-not answer all the same."""
    return INF if t.device.type != "cpu" else 2.0


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """max |x| of ``t`` as a device scalar: NaN when ``t`` holds a NaN, Inf when it holds an Inf, finite
    otherwise, and never overflowed by finite values (a float32 sum of values near 1e38 is Inf: a model
    input of 1e38 was named as the NaN's origin). No host read. On a GPU the inf-norm is one fused
    kernel; on a CPU torch's inf-norm runs at about 1.2 GB/s, ``aminmax`` (one pass) about 15 times faster."""
    if not t.numel():  # an expert that got no tokens, a head with no boxes: nothing non-finite
        return torch.zeros((), dtype=torch.float32, device=t.device)
    if t.device.type == "cpu":
        lo, hi = torch.aminmax(t)
        return torch.maximum(hi, lo.neg())  # maximum() keeps a NaN of either
    return torch.linalg.vector_norm(t, INF)


def max_abs_each(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``finite_flag`` of each tensor, as one vector on the first one's device (one fused kernel on a device
    where they all are)."""
    if len({t.device for t in tensors}) > 1:  # a model over several devices (model parallel by hand, offload)
        return torch.stack([finite_flag(t).to(tensors[0].device) for t in tensors])
    if tensors[0].device.type == "cpu":
        return torch.stack([finite_flag(t) for t in tensors])
    return torch.stack(torch._foreach_norm(tensors, INF))


FIRST_CHECK = "before its first step (as built, initialised or loaded)"
MAX_STATE_CHECKS = 8
"""State checks (below) held until the next step boundary reads them: a script that loads in a loop keeps
the first ones and the last."""


@dataclass
class StateCheck:
    """A model's parameters and buffers checked whole, as they were at one moment: before its first step
    (what it was built, initialised or loaded with) or right after a ``load_state_dict``. A tensor that is
    non-finite there was never made finite by training: not an op's or a batch's NaN."""

    when: str
    where: str  # the user's line of the load ('' when not a load)
    names: list[str]
    flags: torch.Tensor  # max |x| of each, on the device
    refs: list[Any]  # weak references to the tensors: what the script did to them after the check is seen
    missing: list[str]  # the load's missing keys (strict=False: left as they were, not loaded)


def fold_in(acc: dict[Any, torch.Tensor], key: Any, total: torch.Tensor) -> None:
    """acc[key] = max(|acc[key]|, |total|) on the device (``total``: a ``finite_flag`` or a norm): a NaN or
    Inf survives, a finite value cannot overflow, and the record stays one small tensor per key however
    often the key comes (an evaluation loop's all_reduce of metrics, gradient accumulation). The key's
    first value is kept as it is, with no kernel of its own: only finiteness is ever asked of it (the
    common case, one call per key per step, costs the caller's one flag and nothing more)."""
    seen = acc.get(key)
    if seen is None:
        if len(acc) >= MAX_KEYS:
            key = ("…",)
            seen = acc.get(key)
        if seen is None:
            acc[key] = total
            return
    torch.maximum(seen.abs_(), total.abs(), out=seen)


class NanOrigin(Detector):
    name = "nan_origin"
    needs_model = True
    description = ("first NaN/Inf: step, origin rank (local gradients before all-reduce), first parameter in "
                   "backward order, first module in forward order")

    Config = NanOriginConfig

    def __init__(self, config: NanOriginConfig | None = None) -> None:
        self.config = config or NanOriginConfig()
        self.stop = self.config.stop
        self.ctx: RankContext | None = None
        self.names: dict[int, str] = {}  # id(param) -> name as the user wrote it
        self.params: list[tuple[str, torch.nn.Parameter]] = []
        self.grad_ptrs: dict[int, str] = {}
        # Bounded whatever the loop does (any number of forwards, buckets or all_reduces per step): one
        # value per module / parameter group, later ones folded in by max(|sum|) (fold_in).
        self.fwd: dict[str, torch.Tensor] = {}  # module -> |sum| of its outputs this step, in forward order
        # A pipeline stage's input as received: what tells a NaN born here from one received (as comm_in /
        # comm_out below do for tensor-parallel layers).
        self.stage_input: dict[str, torch.Tensor] = {}
        self.shards: dict[str, torch.Tensor] = {}  # FSDP2 module -> its local shards (before the all-gather)
        self.gathered: dict[str, torch.Tensor] = {}  # FSDP2 module -> the parameters it gathered
        self._tp = False  # the model has tensor-parallel layers (runtime.layout)
        self._tp_current: str | None = None  # the TP module whose forward is running (its hooks set it)
        self.comm_in: dict[str, torch.Tensor] = {}  # TP module -> |sum| of what its collectives were given
        self.comm_out: dict[str, torch.Tensor] = {}  # ... and of what they returned
        self.stage: dict[str, Any] | None = None  # the layout's pipeline stage (runtime.layout)
        self.local: dict[tuple[str, ...], torch.Tensor] = {}  # param names -> |sum| of their local gradients
        self.local_source: str | None = None  # "ddp" | "all_reduce"
        self.sharded = False
        self.framework_reduces = False  # FSDP2 / DeepSpeed reduce the gradients inside
        self._ddp_seen: set[int] = set()  # DDP wrappers whose parameters are hooked (ids: never the object)
        self.first_step: int | None = None
        self.count = 0
        self._step_records: tuple[list[Any], list[Any]] = ([], [])  # (fwd, local) of the step being read
        # comm_in, comm_out, stage_input, shards, gathered: of the step being read
        self._forward_records: tuple[dict[str, Any], ...] = ({}, {}, {}, {}, {})
        self._readers: list[tuple[Any, Any]] = []  # (runtime.localgrads.LocalGradNorms, this detector's listener)
        self.watch = self.config.watch  # "on-demand" or "full", as attached (config.NanOriginConfig.watch)
        self.watch_blockers: list[str] = []  # why on-demand watch could not be had here
        self._watch: list[tuple[Any, str, Any, dict[str, Any]]] = []  # the forward's per-step watching
        self._recorder: Any = None  # on-demand watch: the step's capture (runtime.rerun.Recorder, forward only)
        self._capture_handles: list[Any] = []
        self._localised = ""  # why the last on-demand localisation could not run ('' when it ran)
        # Parameters and buffers checked whole before a model's first step and after each load, until the
        # next boundary reads them (bounded: MAX_STATE_CHECKS); those of the step being read.
        self._state: list[StateCheck] = []
        self._state_records: list[StateCheck] = []
        self._first_forward_seen: set[int] = set()  # ids of the models already checked (never the objects)
        self._to_empty_at = ""  # the user's line of the last Module.to_empty() (memory left uninitialised)

    # ------------------------------------------------------------------ wiring
    def setup(self, ctx: RankContext) -> None:
        """From the script's first line: each model's parameters and buffers as its first step's backward
        finds them (as built, initialised or loaded: a forward changes no parameter), and as each
        ``load_state_dict`` leaves them (device values, read with the step's one read); where ``to_empty``
        left memory uninitialised. Parameters that were never finite (a block that ``to_empty()``
        materialised and no ``reset_parameters`` reached; a checkpoint holding NaN) are then told as such, on
        each rank where they are, instead of as the first step's NaN loss. (Checked at the backward, not by a
        global forward hook: removing one later would recompile every compiled graph.)"""
        self.patch(ctx, torch.nn.Module, "load_state_dict", self._after_load)
        self.patch(ctx, torch.nn.Module, "to_empty", self._note_to_empty)

    def _after_load(self, original: Any) -> Any:
        det = self

        def load_state_dict(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            out = original(module, *args, **kwargs)
            det._check_state(module, "right after load_state_dict", user_line(),
                             list(getattr(out, "missing_keys", None) or []))
            return out
        return load_state_dict

    def _note_to_empty(self, original: Any) -> Any:
        det = self

        def to_empty(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            out = original(module, *args, **kwargs)
            det._to_empty_at = user_line() or "?"
            return out
        return to_empty

    def _check_state(self, module: torch.nn.Module, when: str, where: str, missing: list[str] | None = None,
                     buffers: bool = True) -> None:
        """Queue max |x| of each floating parameter and buffer of ``module`` (this rank's shard of a sharded
        one): device work only, read at the next boundary."""
        from torch.nn.parameter import is_lazy

        inner = unwrap(module)[0]
        # FSDP2: the module's parameters may be the gathered ones at this moment (in a step, between the
        # all-gather and the reshard): this rank's own shards are what it holds, and outlive the step.
        qualified = {id(m): n for n, m in inner.named_modules()}
        shards = {}
        for mod in inner.modules():
            for fp in _fsdp_params(mod):
                info = fp._module_info
                owner = qualified.get(id(info.module))
                if owner is not None:
                    shards[f"{owner}.{info.param_name}" if owner else info.param_name] = fp.sharded_param
        tagged = [(n, shards.get(n, t), True) for n, t in inner.named_parameters()] + \
            [(n, t, False) for n, t in (inner.named_buffers() if buffers else ())]
        # not yet materialised (meta, a Lazy module's), or not floating (integer counters, quantised weights)
        named = [(n, t, p) for n, t, p in tagged if isinstance(t, torch.Tensor) and not is_lazy(t)
                 and t.is_floating_point() and t.device.type != "meta"]
        views = [(n, local_view(t), p, t) for n, t, p in named]
        views = [v for v in views if v[1].numel()]
        if not views:
            return
        views.sort(key=lambda v: not v[2])  # parameters first, then buffers
        n_params = sum(v[2] for v in views)
        with torch.no_grad():
            flags = max_abs_each([v for _, v, _, _ in views])
            if n_params < len(views):
                # A buffer may hold an infinity by design (an attention mask of -inf, a sentinel): only a NaN in
                # a buffer is never meant (max |x| is NaN when any value is NaN, Inf when an infinity is and none
                # is). No host value: the tail of the same vector.
                flags[n_params:] = flags[n_params:].nan_to_num(nan=math.nan, posinf=0.0)
        check = StateCheck(when=when, where=where, names=[n for n, _, _, _ in views], flags=flags,
                           refs=[weakref.ref(t) for _, _, _, t in views], missing=missing or [])
        if len(self._state) >= MAX_STATE_CHECKS:
            self._state[-1] = check
        else:
            self._state.append(check)

    def handover(self, successor: Detector) -> None:
        """A new training phase: models already checked are not checked again as if never run (a fresh model,
        a next fold's, is); what was noted before it (a to_empty, a load's pending check) goes on."""
        if isinstance(successor, NanOrigin):
            successor._first_forward_seen |= self._first_forward_seen
            successor._state = self._state + successor._state
            successor._to_empty_at = successor._to_empty_at or self._to_empty_at

    def attach(self, ctx: RankContext) -> None:
        self.ctx = ctx
        many = len(ctx.models) > 1
        roots: list[Any] = list(ctx.models)  # DDP, FSDP2, DeepSpeed or plain: their own methods are used
        # The per-step watching of the forward (module, hook kind, hook, options): on every step in full
        # watch, only while a step is re-executed in on-demand watch; and why on-demand cannot be had.
        watch: list[tuple[Any, str, Any, dict[str, Any]]] = []
        blockers: list[str] = ["several models"] if many else []
        for i, root in enumerate(roots):
            inner, chain, _ = unwrap(root)
            prefix = f"{type(inner).__name__}[{i}]." if many else ""
            ddp = find_ddp(root)
            # TP inside DDP: DDP's own list (its TP parameters leave named_parameters(); runtime.layout)
            for name, p in (ddp_params(ddp) if ddp is not None else None) or inner.named_parameters():
                self.names[id(p)] = prefix + name
                self.params.append((prefix + name, p))
            compiled = False
            # TP layers: modules with parameters sharded by tensor parallelism (the layout's names: also those
            # DDP localised, which after DDP's first forward are no longer listed as parameters; FSDP's
            # own sharding is not TP)
            tp_modules = {n.rsplit(".", 1)[0] if "." in n else "" for n in getattr(ctx.layout, "sharded", [])}
            # Plain and DDP models: every parameter is read whole at every step boundary, so modules whose
            # output is finite given finite parameters and input need no hook; the model's input is checked
            # instead (a bad batch is then named as such). FSDP2 and DeepSpeed gather what the forward uses.
            params_checked = not ({"fsdp2", "deepspeed"} & set(chain))
            stage_index = (getattr(ctx.layout, "stage", None) or {}).get("index", 0)
            if params_checked and stage_index == 0:
                label = f"{prefix}(input of {type(inner).__name__})"
                watch.append((inner, "forward_pre", self._input_hook(label, self.fwd), {}))
            for mod_name, mod in inner.named_modules():
                leaf = next(mod.children(), None) is None
                own = next(mod.parameters(recurse=False), None) is not None
                # no hook where a NaN cannot start: its parameters (none, or checked) and input are watched
                skip = leaf and mod_name not in tp_modules and (params_checked or not own) and finite_preserving(mod)
                if (own or leaf) and not skip:
                    label = prefix + (mod_name or type(inner).__name__)
                    if runs_compiled(mod):  # traced into a compiled graph: no module hook (Detector.hook)
                        compiled = True
                        continue
                    watch.append((mod, "forward", self._forward_hook(label, self.fwd), {}))
                    if mod_name in tp_modules:
                        # From before torch's own output hooks (the TP all-reduce / redistribution) to after
                        # them, torch's functional collectives are watched for this module: a finite input
                        # that came back non-finite was received from its TP peers.
                        watch.append((mod, "forward_pre", self._tp_enter(label), {"prepend": True}))
                        watch.append((mod, "forward", self._tp_enter(label), {"prepend": True}))
                        watch.append((mod, "forward", self._tp_leave(label), {}))
            if "fsdp2" in chain:
                for mod_name, mod in inner.named_modules():
                    params = _fsdp_params(mod)
                    if params:  # its shards before the all-gather, and the parameters it gathered
                        self.hook(mod, "forward_pre", self._shard_hook(prefix + mod_name, params, True), prepend=True)
                        self.hook(mod, "forward_pre", self._shard_hook(prefix + mod_name, params, False))
            self._tp |= bool(tp_modules)
            if tp_modules and self._observe not in ctx.communication_observers:
                ctx.communication_observers.append(self._observe)
            layout = ctx.layout
            self.stage = getattr(layout, "stage", None)
            if self.stage is not None and self.stage.get("index", 0) > 0:
                # A later pipeline stage's input is what the previous stage sent (a P2P receive).
                self.hook(inner, "forward_pre", self._input_hook(prefix + type(inner).__name__))
            if compiled:  # modules inside a compiled region get no hook: the flag is the whole model's
                # output, from the eager wrapper around it (a root compiled in place gets none)
                watch.append((root, "forward", self._forward_hook(prefix + type(inner).__name__, self.fwd), {}))
                blockers.append("a compiled model")
            if "fsdp2" in chain or "deepspeed" in chain:
                blockers.append("FSDP2" if "fsdp2" in chain else "DeepSpeed")
        framework_reduces = self.framework_reduces = any({"fsdp2", "deepspeed"} & set(unwrap(r)[1]) for r in ctx.models)
        # Plain tensors are read as they are (no_grad); DTensors and others through their local shard.
        self.sharded = any(type(p) is not torch.nn.Parameter for _, p in self.params)
        self._watch = watch
        self._choose_watch(ctx, blockers)
        if self.local_source is None and not framework_reduces:
            import torch.distributed as dist

            raw = ctx.raw_collectives.get("all_reduce")
            current = getattr(dist, "all_reduce", None)
            if raw is not None and current is not None:
                self.patch(ctx, dist, "all_reduce", self._all_reduce_wrapper)
                self.local_source = "all_reduce"

    def _choose_watch(self, ctx: RankContext, blockers: list[str]) -> None:
        """On-demand watch where the step's forward can be re-executed on this rank alone, else full watch
        (config.watch, and the README's list of what re-execution cannot do)."""
        layout = ctx.layout
        if getattr(layout, "sharded", None):
            blockers.append("tensor parallelism")
        if self.stage is not None:
            blockers.append("pipeline parallelism")
        if getattr(layout, "model_parallel_by_hand", None):
            blockers.append("collectives inside the forward")
        if self.sharded:
            blockers.append("sharded parameters")
        rec = None
        if self.config.watch == "on-demand" and not blockers:
            from distdebug.runtime.rerun import Recorder
            from distdebug.runtime.session import current_session

            session = current_session()
            if session is None or not ctx.models:
                blockers.append("no training session")
            else:
                # The step in progress is the session's last boundary + 1; the collectives it counts tell a
                # forward that communicates (then the watch turns full: _check_capture).
                rec = Recorder(unwrap(ctx.models[0])[0], keep=1, step_of=lambda: session.step + 1,
                               collectives=lambda: session.progress.collective_seq, forward_only=True)
                if rec.communicates:
                    blockers.append("SyncBatchNorm")
                elif not rec.params:
                    blockers.append("no trained parameters")
                if blockers:
                    rec = None
        self.watch_blockers = blockers
        if rec is None:
            self._watch_fully()
            return
        self.watch = "on-demand"
        self._recorder = rec
        self._capture_handles = [self.hook(rec.module, "forward_pre", rec.forward_pre, with_kwargs=True),
                                 self.hook(rec.module, "forward", rec.forward_post, with_kwargs=True)]

    def _watch_fully(self) -> None:
        """Every watched module's output checked in every step's forward from now on (full watch)."""
        self.watch = "full"
        self._recorder = None
        for h in self._capture_handles:
            if h is not None:
                h.remove()
        self._capture_handles = []
        for mod, kind, fn, kwargs in self._watch:
            self.hook(mod, kind, fn, **kwargs)

    def _check_capture(self) -> None:
        """A step whose forward communicated (a collective inside it): no step can be re-executed alone, so
        full watch from now on. Other reasons (too many calls in one step) concern that step only."""
        rec = self._recorder
        cap = rec.current if rec is not None else None
        if cap is not None and cap.communicates:
            self.watch_blockers = [cap.problem or "the forward communicates"]
            self._watch_fully()

    def _localise(self, step: int) -> tuple[list[tuple[str, torch.Tensor]], str]:
        """On-demand watch, the rare path: re-execute ``step``'s forward from its capture with every module
        watched (the hooks full watch keeps on every step), on this rank alone; every other hook of the
        harness passes meanwhile, injected faults act (Session.replay_step: the step they see). Returns the
        module flags in forward order and '' or, when it could not run, [] and why."""
        rec = self._recorder
        cap = rec.last(step) if rec is not None else None
        if cap is None:
            return [], "the step's inputs were not held (its first forward came before the model was found)"
        if cap.problem:
            return [], cap.problem
        if not cap.calls:
            return [], "no forward call of the model with gradients on in the step"
        from distdebug.runtime.rerun import replay_forward
        from distdebug.runtime.session import current_session

        session = current_session()
        handles = []
        self.fwd.clear()
        try:
            for mod, kind, fn, kwargs in self._watch:  # not guarded by Detector.paused, which replay sets
                handles.append(getattr(mod, f"register_{kind}_hook")(_quiet(fn), **kwargs))
            with session.replay(step) if session is not None else contextlib.nullcontext():
                replay_forward(rec, cap)
            return list(self.fwd.items()), ""
        except Exception as e:  # the model raised when run again: no module named, the rest stands
            return [], f"the re-execution raised {type(e).__name__}: {e}"
        finally:
            for h in handles:
                h.remove()
            self.fwd.clear()

    def _tp_enter(self, label: str) -> Any:
        def hook(module: torch.nn.Module, *args: Any) -> None:
            self._tp_current = label if torch.is_grad_enabled() else None
        return hook

    def _tp_leave(self, label: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            self._tp_current = None
        return hook

    def _observe(self, inp: Any, out: Any) -> None:
        """A functional collective inside a TP module's forward: its input and output, as device flags."""
        label = self._tp_current  # set only in training forwards (the collective itself runs inside an autograd
        if label is None:         # Function's forward, where grad mode is off)
            return
        for acc, t in ((self.comm_in, inp), (self.comm_out, out)):
            t = getattr(t, "_local_tensor", t)
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                fold_in(acc, label, finite_flag(t.detach()))

    def _forward_hook(self, label: str, fwd: dict[str, torch.Tensor]) -> Any:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            if not torch.is_grad_enabled():
                return  # evaluation and inference forwards: not training, and never kept (memory stays flat)
            t = out if type(out) is torch.Tensor else first_tensor(out)
            t = getattr(t, "_local_tensor", t)  # a DTensor's local part: summing a DTensor may communicate
            if t is not None and t.is_floating_point():
                # One pass, no temporary: max |x| keeps a NaN or Inf and, unlike a sum, is never
                # overflowed by finite values. One value per module per step, whatever the number of
                # forwards: later ones fold in by max. Forward order is first-call order.
                fold_in(fwd, label, finite_flag(t.detach()))
        return hook

    def _shard_hook(self, label: str, params: list[Any], sharded: bool) -> Any:
        """FSDP2: whether this rank's shards of the module's parameters are finite (before its all-gather)
        and whether the gathered parameters are (after it): a NaN in another rank's shard reaches every
        rank of the group through the all-gather, and only the rank holding it is its origin."""
        acc = self.shards if sharded else self.gathered

        def hook(module: torch.nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled():
                return
            ts = []
            for fp in params:
                t = fp.sharded_param if sharded else getattr(fp._module_info.module, fp._module_info.param_name, None)
                t = getattr(t, "_local_tensor", t)
                if isinstance(t, torch.Tensor) and t.numel() and t.is_floating_point():
                    ts.append(t.detach())
            if ts:
                fold_in(acc, label, torch.stack(torch._foreach_norm(ts, INF)).amax())  # a sum of maxima overflows
        return hook

    def _input_hook(self, label: str, acc: dict[str, torch.Tensor] | None = None) -> Any:
        """The module's first floating-point input: a later pipeline stage's (into ``stage_input``), or the
        model's own (into ``acc``, first in forward order)."""
        into = self.stage_input if acc is None else acc

        def hook(module: torch.nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled():
                return
            t = first_tensor(args)
            t = getattr(t, "_local_tensor", t)
            if t is not None and t.is_floating_point():
                fold_in(into, label, finite_flag(t.detach()))
        return hook

    # ------------------------------------------------------------------ DDP: local gradients
    def before_backward(self, ctx: RankContext) -> None:
        """Before a DDP model's first backward: a hook on each of its parameters that sees the local
        gradient once autograd has accumulated it, before DDP's reducer copies it into its bucket and
        reduces it. DDP's reduction itself (its default path, or the script's own communication hook,
        registered at any time) is never touched: the training is bitwise the same by construction."""
        for root in ctx.models:
            if id(root) not in self._first_forward_seen:
                self._first_forward_seen.add(id(root))  # ids only, never the objects
                # Parameters only: a training forward has already updated buffers (BatchNorm's running
                # statistics take in a NaN made downstream of a bad parameter); buffers are checked as a load
                # leaves them.
                self._check_state(root, FIRST_CHECK, "", buffers=False)
        for root in ctx.models:
            ddp = find_ddp(root)
            if ddp is None or id(ddp) in self._ddp_seen:
                continue
            self._ddp_seen.add(id(ddp))
            named = [(name, p) for name, p in unwrap(ddp)[0].named_parameters() if p.requires_grad]
            if getattr(ddp, "gradient_as_bucket_view", True):
                # The gradients are views of DDP's buckets, reduced in place as each bucket is ready: only
                # a hook per parameter sees them before that.
                for name, p in named:
                    self.hook(p, "post_accumulate_grad", self._local_grad_hook((name,)))
            else:
                # DDP's default: the reducer reduces copies in its buckets and copies the results back into
                # .grad when it finalises, at the end of the backward. Until then .grad is this rank's own:
                # one fused norm of them all when the graph is done, shared with loss_spike
                # (runtime.localgrads), in place of a Python hook and a kernel per parameter.
                shared = local_grad_norms(ctx, ddp)
                listener = self.guarded(self._local_norms)
                shared.listeners.append(listener)
                self._readers.append((shared, listener))
            self.local_source = "ddp"

    def _local_grad_hook(self, key: tuple[str, ...]) -> Any:
        local = self

        def hook(param: torch.Tensor) -> None:
            g = param.grad
            if g is not None and g.layout == torch.strided:
                fold_in(local.local, key, finite_flag(g.detach()))
        return hook

    def _local_norms(self, key: tuple[str, ...], norms: torch.Tensor) -> None:
        """At the end of a syncing backward, before DDP copies the reduced gradients back: the norm of each
        local gradient (runtime.localgrads), folded in under the tuple of their names. A NaN or Inf gives a
        non-finite norm; so may a finite gradient past ~1e19, which the rare path tells apart (on_step)."""
        fold_in(self.local, key, norms)

    def _all_reduce_wrapper(self, current: Any) -> Any:
        det = self

        def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                name = det._grad_name(tensor)
                fold_in(det.local, (name,), finite_flag(tensor.detach()))
            return current(tensor, *args, **kwargs)

        return all_reduce

    def _grad_name(self, t: torch.Tensor) -> str:
        ptr = t.data_ptr()
        if ptr not in self.grad_ptrs:
            self.grad_ptrs = {p.grad.data_ptr(): n for n, p in self.params if p.grad is not None}
        name = self.grad_ptrs.get(ptr)
        return name or f"a flattened gradient buffer {tuple(t.shape)} (all_reduce)"

    # ------------------------------------------------------------------ per step
    def probe(self, step: int) -> dict[str, Any] | None:
        """One fused check of the step's flags and the parameters after the step, as one device scalar."""
        if self.ctx is None:
            return None
        if self._recorder is not None:
            self._check_capture()
        fwd = list(self.fwd.items())
        self.fwd.clear()  # the hooks hold this dict
        local = list(self.local.items())
        self.local = {}
        self._step_records = (fwd, local)
        self._forward_records = (dict(self.comm_in), dict(self.comm_out), dict(self.stage_input), dict(self.shards),
                                 dict(self.gathered))
        for acc in (self.comm_in, self.comm_out, self.stage_input, self.shards, self.gathered):
            acc.clear()
        self._state_records, self._state = self._state, []
        # The parameters after the step, not the gradients: an optimizer's update spreads a non-finite
        # gradient into its parameter (a loss scaler's skipped step aside, which is not a finding), so one
        # pass over the parameters says it for both (the gradients are named on the rare path).
        tensors = [local_view(p) for _, p in self.params] if self.sharded else [p for _, p in self.params]
        tensors = [t for t in tensors if t.numel()]  # a rank's shard may be empty
        with torch.no_grad():
            scalars = [f for _, f in fwd] + [v for _, v in local if not v.dim()]
            if tensors:
                # float32: an fp16 parameter's own norm overflows past 65504
                scalars += torch._foreach_norm(tensors, _finite_norm(tensors[0]), dtype=torch.float32)
            # one vector per end-of-backward reading (a value per local gradient)
            pieces = ([torch.stack(scalars)] if scalars else []) + [v for _, v in local if v.dim()]
            # a model loaded (or first run) on the CPU and trained on a GPU: its checks join the step's device
            device = pieces[0].device if pieces else None
            pieces += [c.flags if device is None or c.flags.device == device else c.flags.to(device)
                       for c in self._state_records]
            if not pieces:
                return None
            # Every piece is a max |x| or a norm (never negative): their maximum keeps a NaN or Inf and cannot
            # overflow, as a sum of values near a dtype's maximum would. One reduction per step, read with
            # everything else.
            flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            out = {"total": flat.amax()}
            if fwd:  # the forward's own flags: what tells a real NaN from a loss scaler's overflow
                out["forward"] = torch.stack([f for _, f in fwd]).amax()
            return out

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        if self.ctx is None:
            return ()
        fwd, local = self._step_records
        self._step_records = ([], [])
        comm_in, comm_out, stage_input, shards, gathered = self._forward_records
        self._forward_records = ({}, {}, {}, {}, {})
        values = self.values(event)
        total = values.get("total")
        finite = total is None or math.isfinite(total)
        loss_finite = event.loss is None or math.isfinite(event.loss)
        checks, self._state_records = self._state_records, []
        if finite and loss_finite:
            return ()
        never = self._never_finite(event, checks)
        if never is not None:
            return self._emit(never) if self._first_of_run(event) else ()
        forward = values.get("forward")
        skipped = event.skipped and loss_finite
        localised = self._recorder is not None and (skipped or self.first_step is None)
        if localised:  # on-demand watch: the step's forward again, every module watched (the rare path)
            fwd, self._localised = self._localise(event.step)
            if fwd:
                forward = float(torch.stack([v for _, v in fwd]).amax())  # one read
        forward_finite = forward is None or math.isfinite(forward)
        if loss_finite and forward_finite and not skipped and not self._nonfinite_now():
            # The norms said non-finite, the values say finite: a finite gradient or parameter past ~1e19,
            # whose float32 square overflowed in its 2-norm (runtime.localgrads). Not a NaN/Inf.
            return ()
        if skipped and forward_finite:
            # A loss scaler found non-finite (scaled) gradients and skipped the update, as it is meant
            # to: the forward and the loss were finite, the parameters did not change. Not a NaN of the
            # training's; the flags are cleared, so nothing carries into the next step (loss_scale says it).
            return ()
        if not self._first_of_run(event):
            return ()
        finding = (self._before(event) or self._received(event, fwd, comm_in, comm_out, stage_input, shards, gathered)
                   or self._explain(event, fwd, local))
        if event.skipped:  # the non-finite forward or loss made the scaled gradients overflow too
            finding.message += ("; the loss scaler skipped this step's update (its scaled gradients were non-finite), "
                                "but the forward or the loss was already non-finite: not an overflow of the scale")
            finding.evidence["loss_scaler_skipped_step"] = True
        if localised and finding.evidence.get("first_nonfinite_module_output") is None:
            finding.evidence["localisation"] = self._localised or (
                "the step's forward, re-executed on this rank from its inputs and parameters, was finite in every "
                "watched module: the non-finite value did not come from the forward again (a transient fault: "
                "--rerun-on-anomaly tells; or it was born in the backward or the update)")
        return self._emit(finding)

    def _first_of_run(self, event: StepEvent) -> bool:
        """Count a non-finite step; whether it is the run's first (the one found; later ones are counted)."""
        self.count += 1
        if self.first_step is not None:
            return False
        self.first_step = event.step
        return True

    def _emit(self, finding: Finding) -> tuple[Finding, ...]:
        """The run's first finding, with the watch that ran; --stop-on-nan ends the rank once it is written."""
        finding.evidence["watch"] = self.watch
        if self.stop and self.ctx is not None:
            self.ctx.report(finding)
            raise SystemExit(EXIT_NAN)
        return (finding,)

    def _before(self, event: StepEvent) -> Finding | None:
        """On-demand watch: the parameters as this step's forward found them (its capture) were non-finite,
        while they were finite at the previous step's end (checked there): written between the steps, by
        something other than the optimizer's step (a checkpoint loaded, a manual edit, a memory fault).
        Named so; re-executing the forward would only show every module after them non-finite."""
        rec = self._recorder
        cap = rec.last(event.step) if rec is not None else None
        if cap is None:
            return None
        bad = [n for n, t in zip(rec.param_names, cap.params, strict=True)  # the rare path: read here
               if t.numel() and not bool(t.isfinite().all())]
        if not bad:
            return None
        rank, step = event.rank, event.step
        return Finding(
            severity=Severity.ERROR, detector=self.name, ranks=[rank], step=step, subject=bad[0],
            message=f"NaN/Inf on rank {rank} at step {step}: parameters were non-finite when the step's forward began "
                    f"(first in the model's order: {bad[0]}; {len(bad)} in all) and finite at the end of step "
                    f"{step - 1}: written between the steps, not by the optimizer's step",
            evidence={"parameters_nonfinite_before_step": bad[:50], "origin": "this rank",
                      "loss": None if event.loss is None else str(event.loss)},
            fix="look for what writes the parameters between optimizer steps on this rank (a checkpoint loaded, "
                "an in-place edit of .data, a weight-tying or EMA update); a flipped bit in memory if nothing does")

    def _never_finite(self, event: StepEvent, checks: list[StateCheck]) -> Finding | None:
        """Parameters or buffers that were non-finite before the first step or right after a load (the rare
        path: the checks' flags read here): named as such, with the likely cause, not as a NaN of the step."""
        for check in checks:
            bad = [n for n, x, ref in zip(check.names, check.flags.tolist(), check.refs, strict=True)
                   if not math.isfinite(x) and _still_nonfinite(ref())]
            if bad:
                break
        else:
            return None  # made finite after the check (a strict=False load, then the script's own init)
        rank, step = event.rank, event.step
        at = f" at {check.where}" if check.where else ""
        missing = [n for n in bad if any(k == n or k.endswith("." + n) or n.endswith("." + k) for k in check.missing)]
        if check.where and missing:
            cause = (f"not in the checkpoint loaded{at} (strict=False: its missing keys {', '.join(missing[:5])} were "
                     "left as they were" + (f", uninitialised after to_empty() at {self._to_empty_at}" if
                                             self._to_empty_at else "") + ")")
            fix = "initialise the tensors the checkpoint does not hold, after the load (or save them with it)"
        elif check.where:
            cause = (f"the checkpoint loaded{at} holds NaN/Inf in these tensors (saved from a run that had already "
                     "diverged, or written wrongly)")
            fix = ("load an earlier checkpoint, or find where this one became non-finite (distdebug report on the run "
                   "that saved it); check which tensors a partial load leaves as they were")
        elif self._to_empty_at:
            cause = (f"uninitialised memory: to_empty() at {self._to_empty_at} allocates the model's tensors without "
                     "initialising them, and these were never initialised after it (their modules' "
                     "reset_parameters() or the script's init_weights did not reach them)")
            fix = ("initialise every module after to_empty(): call reset_parameters() on each module that has one "
                   "and initialise the rest (the named tensors) explicitly, or load a checkpoint into them")
        else:
            cause = ("the tensors were never initialised (torch.empty, a model materialised from the meta device "
                     "without an init) or were written non-finite before the first step (a checkpoint loaded "
                     "without load_state_dict)")
            fix = "initialise the named tensors before training (or load a finite checkpoint into them)"
        head = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        return Finding(
            severity=Severity.ERROR, detector=self.name, ranks=[rank], step=step, subject=bad[0],
            message=f"parameters or buffers were non-finite on rank {rank} {check.when}{at}, before any training "
                    f"step changed them: {head} ({len(bad)} of {len(check.names)} tensors). Not an op's or a "
                    f"batch's NaN: every step from step {step} computes with them",
            evidence={"nonfinite_state": bad[:50], "checked": check.when, "loaded_at": check.where or None,
                      "to_empty_at": self._to_empty_at or None, "likely_cause": cause, "origin": "this rank",
                      "loss": None if event.loss is None else str(event.loss)},
            fix=fix,
        )

    def _nonfinite_now(self) -> bool:
        """Whether a gradient (as reduced) or a parameter holds a NaN or Inf (the rare path: read here)."""
        for _, p in self.params:
            for t in (p, p.grad):
                if t is not None and t.numel() and not bool(local_view(t).isfinite().all()):
                    return True
        return False

    def _received(self, event: StepEvent, fwd: list[tuple[str, torch.Tensor]], comm_in: dict[str, torch.Tensor],
                  comm_out: dict[str, torch.Tensor], stage_input: dict[str, torch.Tensor],
                  shards: dict[str, torch.Tensor], gathered: dict[str, torch.Tensor]) -> Finding | None:
        """A NaN that came into this rank in the forward, through communication: a pipeline stage's input
        from the previous stage, or a tensor-parallel layer whose local result was finite and whose output
        after torch's all-reduce / redistribution was not. Not an origin: a warning naming how it came.
        (Read only on the rare path, after the step's one read said something is non-finite.)"""
        step = event.step
        bad_input = next((n for n, v in stage_input.items() if not math.isfinite(float(v))), None)
        stage = self.stage or {}
        if bad_input is not None:
            prev = stage.get("index", 1) - 1
            ranks = stage.get("ranks") or []
            src = f" (rank {ranks[prev % len(ranks)]})" if ranks else ""
            return self._received_finding(
                event, bad_input, f"(pipeline stage {stage.get('index')}) at step {step} in its input, received "
                f"from pipeline stage {prev}{src}", "pipeline receive", None, from_stage=prev)
        bad_module = next((name for name, total in fwd if not math.isfinite(float(total))), None)
        if bad_module is None:
            return None
        bad_gather = next((lbl for lbl, v in gathered.items() if not math.isfinite(float(v))
                           and (not lbl or bad_module == lbl or bad_module.startswith(lbl + "."))
                           and lbl in shards and math.isfinite(float(shards[lbl]))), None)
        if bad_gather is not None:
            return self._received_finding(
                event, bad_module, f"at step {step} through FSDP's parameter all-gather of "
                f"{bad_gather or 'the root module'}: this rank's shards were finite and the gathered parameters "
                "were not (another rank's shard is non-finite)", "FSDP parameter all-gather", bad_module)
        sent, got = comm_in.get(bad_module), comm_out.get(bad_module)
        if sent is None or got is None or not math.isfinite(float(sent)) or math.isfinite(float(got)):
            return None  # born here (also when a forward hook of the module's own, not the communication, made it)
        return self._received_finding(
            event, bad_module, f"at step {step} through the forward communication of tensor-parallel module "
            f"{bad_module}: what this rank gave its all-reduce / redistribution was finite and what came back "
            "from its TP peers was not", "tensor-parallel forward communication", bad_module)

    def _received_finding(self, event: StepEvent, subject: str, how: str, through: str, module: str | None,
                          **evidence: Any) -> Finding:
        return Finding(
            severity=Severity.WARNING, detector=self.name, ranks=[event.rank], step=event.step, subject=subject,
            message=f"NaN/Inf reached rank {event.rank} {how}: not born here; the origin is the rank whose "
                    "nan_origin finding says 'started on'",
            evidence={"origin": "another rank", "received_through": through,
                      "first_nonfinite_module_output": module, **evidence},
        )

    def _explain(self, event: StepEvent, fwd: list[tuple[str, torch.Tensor]],
                 local: list[tuple[tuple[str, ...], torch.Tensor]]) -> Finding:
        rank, step = event.rank, event.step
        loss_finite = event.loss is None or math.isfinite(event.loss)
        bad_module = next((name for name, total in fwd if not math.isfinite(float(total))), None)
        # Backward order runs from the last parameters to the first.
        bad_grads = [n for n, p in reversed(self.params)
                     if p.grad is not None and not bool(local_view(p.grad).isfinite().all())]
        # Parameters in a bucket (or all_reduce input) that was non-finite here before the reduction;
        # named by their gradients after it (the reduction spreads, it does not move, a NaN).
        suspects = {n for names, v in local for n in _nonfinite(names, v)}
        # A norm (runtime.localgrads) of a finite gradient past ~1e19 overflows float32: a parameter whose
        # reduced gradient is finite had a finite local one (a reduction spreads a NaN or Inf, it never
        # removes one), so it is no suspect. Flattened buffers keep their own names.
        nonfinite = set(bad_grads)
        finite_grads = {n for n, p in self.params if p.grad is not None and n not in nonfinite}
        bad_local = [n for n in bad_grads if n in suspects] or sorted(suspects - finite_grads)
        bad_params = [n for n, p in self.params if not bool(local_view(p).isfinite().all())]
        evidence = {
            "loss": None if event.loss is None else str(event.loss),
            "first_nonfinite_module_output": bad_module,
            "local_gradients_nonfinite": bad_local[:50],
            "local_gradients_seen_by": self.local_source,
            "reduced_gradients_nonfinite": bad_grads[:50],
            "parameters_nonfinite_after_step": bad_params[:50],
        }
        where = []
        if bad_module:
            where.append(f"first non-finite module output in forward order: {bad_module}")
        if event.loss is not None and not math.isfinite(event.loss):
            where.append(f"loss {event.loss}")
        fix = ("look at the named module's inputs and weights at that step (a log of a non-positive number, a "
               "division by zero, an overflow in fp16/bf16, a bad batch); lower the learning rate or clip "
               "gradients if the values grow before")
        if bad_local:
            where.insert(0, f"first parameter in backward order with a non-finite local gradient (before "
                            f"all-reduce): {bad_local[0]}")
            return Finding(
                severity=Severity.ERROR, detector=self.name, ranks=[rank], step=step,
                subject=bad_module or bad_local[0],  # where it was born: the forward's module, else the gradient
                message=f"NaN/Inf started on rank {rank} at step {step}: " + "; ".join(where),
                evidence={**evidence, "origin": "this rank"}, fix=fix,
            )
        if self.local_source and local and bad_grads:
            return Finding(
                severity=Severity.WARNING, detector=self.name, ranks=[rank], step=step, subject="gradients",
                message=f"non-finite gradients reached rank {rank} through all-reduce at step {step}; its own local "
                        f"gradients were finite (first non-finite after reduction: {bad_grads[0]}): the origin is "
                        "the rank whose nan_origin finding says 'started on'",
                evidence={**evidence, "origin": "another rank"},
            )
        if self.framework_reduces:
            # FSDP2 and DeepSpeed reduce gradients inside: local gradients cannot be seen, but the forward
            # and the loss come before any reduction. A rank whose forward made the first non-finite output
            # (or whose loss was) is where it started; one whose forward and loss were finite received it.
            if bad_module is not None or not loss_finite:
                if bad_module is not None:
                    where[0] += " (before any gradient reduction)"
                if bad_grads:
                    where.append(f"first non-finite gradient in backward order: {bad_grads[0]}")
                return Finding(
                    severity=Severity.ERROR, detector=self.name, ranks=[rank], step=step,
                    subject=bad_module or "loss",
                    message=f"NaN/Inf started on rank {rank} at step {step}: " + "; ".join(where),
                    evidence={**evidence, "origin": "this rank (forward)"}, fix=fix,
                )
            if bad_grads or bad_params:
                return Finding(
                    severity=Severity.WARNING, detector=self.name, ranks=[rank], step=step, subject="gradients",
                    message=f"non-finite gradients reached rank {rank} at step {step} through the framework's gradient "
                            f"reduction; its own forward outputs and loss were finite (first non-finite gradient: "
                            f"{bad_grads[0] if bad_grads else '-'}): the origin is the rank whose nan_origin finding "
                            "says 'started on' (if none does, a backward produced it)",
                    evidence={**evidence, "origin": "another rank"},
                )
        if self._tp and bad_module is None and loss_finite and (bad_grads or bad_params):
            # Tensor parallel: the forward and the loss were finite here, the gradients were not. The TP
            # layers' backward all-reduces the input gradients across the TP peers: it came from one of them.
            return self._received_finding(
                event, "gradients", f"at step {step} in the backward, through the tensor-parallel layers' gradient "
                f"all-reduce with its TP peers: its forward outputs and loss were finite (first non-finite "
                f"gradient: {bad_grads[0] if bad_grads else '-'})", "tensor-parallel backward communication", None)
        subject = bad_module or (bad_grads[0] if bad_grads else bad_params[0] if bad_params else "loss")
        if bad_grads:
            where.append(f"first non-finite gradient in backward order: {bad_grads[0]}")
        if bad_params:
            where.append(f"first non-finite parameter after the step: {bad_params[0]}")
        unknown = "" if self.local_source else " (gradients are reduced inside the framework here, so the rank " \
                                                "it started on cannot be told from local gradients)"
        return Finding(
            severity=Severity.ERROR, detector=self.name, ranks=[rank], step=step, subject=subject,
            message=f"NaN/Inf on rank {rank} at step {step}: " + ("; ".join(where) or "non-finite values") + unknown,
            evidence={**evidence, "origin": "unknown" if not self.local_source else "this rank"}, fix=fix,
        )

    def on_end(self) -> Iterable[Finding]:
        if self.ctx is not None and self._observe in self.ctx.communication_observers:
            self.ctx.communication_observers.remove(self._observe)
        for shared, listener in self._readers:  # not told of later backwards once over
            if listener in shared.listeners:
                shared.listeners.remove(listener)
        self._readers = []
        if self.count > 1 and self.ctx is not None:
            return (Finding(
                severity=Severity.INFO, detector=self.name, ranks=[self.ctx.rank], step=self.first_step,
                subject="non-finite steps", message=f"values stayed non-finite in {self.count} steps from step "
                                                     f"{self.first_step} on", evidence={"nonfinite_steps": self.count},
            ),)
        return ()


def _still_nonfinite(t: Any) -> bool:
    """Whether a tensor checked earlier still holds a NaN or Inf now (gone: as it was checked). Rare path."""
    if t is None:
        return True
    with torch.no_grad():
        v = local_view(t)
        if v.untyped_storage().nbytes() < (v.storage_offset() + v.numel()) * v.element_size():
            return True  # its memory was let go (a framework's freed buffer): as it was checked
        return bool(v.numel()) and not bool(v.isfinite().all())


def _quiet(fn: Any) -> Any:
    """A hook for the length of one re-execution: an exception of ours is swallowed (no module named)."""
    def hook(*args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            pass
    return hook


def _nonfinite(names: tuple[str, ...], v: torch.Tensor) -> list[str]:
    """The names whose value in ``v`` is non-finite: one value per name (end-of-backward reading), or one
    for all of them (a bucket or an all_reduce input). Rare path: reads the values."""
    values = v.reshape(-1).tolist()
    if len(values) == len(names):
        return [n for n, x in zip(names, values, strict=True) if not math.isfinite(x)]
    return list(names) if not all(math.isfinite(x) for x in values) else []


def _fsdp_params(module: Any) -> list[Any]:
    """The parameters an FSDP2 module shards and gathers itself (its FSDPParams), or []."""
    get = getattr(module, "_get_fsdp_state", None)
    if get is None:
        return []
    group = getattr(get(), "_fsdp_param_group", None)
    params = list(getattr(group, "fsdp_params", None) or [])
    return [p for p in params if hasattr(p, "sharded_param") and hasattr(p, "_module_info")]


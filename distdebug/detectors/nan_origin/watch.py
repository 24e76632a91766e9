"""The per-step finiteness watch: which modules get a forward hook (and which need none), the model's
and a pipeline stage's input, the wiring of every other mechanism onto the models found (``attach``), and
the step boundary's one fused check (``probe``).

Why a mechanism of its own: this is the cost every healthy step pays, so it is kept to device flags and one
scalar read with the harness's other values (runtime.readout); whether the module hooks run in every step
(full watch) or only when a step is re-executed (on-demand) is replay.py's choice."""

from __future__ import annotations

from typing import Any

import torch

from distdebug.context import RankContext
from distdebug.detectors.nan_origin.collectives import Collectives, fsdp_params
from distdebug.detectors.nan_origin.flags import finite_flag, finite_norm, finite_preserving, fold_in
from distdebug.detectors.nan_origin.gradients import LocalGradients
from distdebug.detectors.nan_origin.replay import Replay
from distdebug.envvars import device_path_forced
from distdebug.fingerprint.hashing import local_view
from distdebug.runtime.discovery import ddp_params, find_ddp, first_tensor, runs_compiled, unwrap

FEW = 16
"""Flags handed to the step's read one by one up to this many; more go as one vector (one op), so that the read's
Python never grows with the model's modules or parameters."""
_ZERO = torch.zeros((), dtype=torch.float32)
_INF = torch.full((), float("inf"), dtype=torch.float32)
"""The host pass's answer for the parameters, as the flag the device path would give (a constant: no kernel)."""


class Watch(Replay, Collectives, LocalGradients):
    """Hooks the forward, chooses the watch, reads the step's flags as one device scalar."""

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
                    params = fsdp_params(mod)
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
        self._plain = [p for _, p in self.params]  # probe's list, the same every step
        self._watch = watch
        self._choose_watch(ctx, blockers)
        if self.local_source is None and not framework_reduces:
            import torch.distributed as dist

            raw = ctx.raw_collectives.get("all_reduce")
            current = getattr(dist, "all_reduce", None)
            if raw is not None and current is not None:
                self.patch(ctx, dist, "all_reduce", self._all_reduce_wrapper)
                self.local_source = "all_reduce"

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

    def probe(self, step: int) -> dict[str, Any] | None:
        """The step's flags and the parameters' check after the step, handed to the step's one read as they are."""
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
        if self.sharded:
            tensors = [t for t in (local_view(p) for _, p in self.params) if t.numel()]  # a shard may be empty
        else:  # the same list every step, not remade (the host's pass passes an empty tensor over)
            tensors = self._plain
        with torch.no_grad():
            # Every flag and norm goes to the step's read as it is, and is judged on the host (finite or not):
            # no stack, cat or max of this detector's own (issue 62: five launches a step on a GPU for one bit).
            rest = [v for _, v in local]  # a scalar or a vector (a value per local gradient) per end of backward
            # On a CPU, one pass over the parameters' exponent bits on the host (fingerprint.hostpass): torch's
            # multi-tensor norm falls back there to a kernel a tensor, 3 us each. On a device, the fused norm.
            host = None if not tensors or device_path_forced() else self._host_params.any_nonfinite(tensors)
            if host is not None:
                rest.append(_INF if host else _ZERO)
            elif tensors and (tensors := [t for t in tensors if t.numel()]):
                # float32: an fp16 parameter's own norm overflows past 65504. One vector (one op): a value a tensor
                # would cost the read's Python a step per parameter
                rest.append(torch.stack(torch._foreach_norm(tensors, finite_norm(tensors[0]), dtype=torch.float32)))
            # a model loaded (or first run) on the CPU and trained on a GPU: its checks join the step's device, so
            # that the step stays one read
            first = rest[0] if rest else (fwd[0][1] if fwd else None)
            device = None if first is None else first.device
            rest += [c.flags if device is None or c.flags.device == device else c.flags.to(device)
                     for c in self._state_records]
            out: dict[str, Any] = {}
            if fwd:  # the forward's own flags: what tells a real NaN from a loss scaler's overflow
                flags = [f for _, f in fwd]  # one or a few (on-demand watch); a module each in full watch: one vector
                out["forward"] = flags if len(flags) <= FEW else [torch.stack(flags)]
            if rest:
                out["rest"] = rest
            return out or None

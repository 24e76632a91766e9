"""Which tensors are replicas (must be bitwise equal across some set of ranks), named as the user wrote them.

- DDP, a plain module with hand-written all-reduce, DeepSpeed ZeRO-1/2: parameters, gradients after
  reduction, buffers and optimizer state (ZeRO partitions its optimizer state: left out there).
  Every rank holds them: they are compared across all ranks.
- HSDP (FSDP2 ``fully_shard`` on a 2-D mesh, DTensors ``(Replicate(), Shard(0))``) and any DTensor
  replicated on some mesh dimension: the local shard of a parameter, its gradient and its optimizer
  state are equal across the ranks that share the coordinates on the other mesh dimensions (the
  replicate group). Such names carry their group: ``layers.0.weight@replicas[0,2]``. A group that is
  the whole world gets no suffix.
- Fully sharded parameters (FSDP2 full shard, ZeRO-3): shards differ by design and are never
  compared. What is truly replicated is the unsharded parameter each rank sees in forward; it is
  fingerprinted by a forward pre-hook that runs after the framework's own unshard/gather hook.
- Buffers are replicated under every wrapper.
- Which ranks must agree on a tensor is the rank's layout's answer (``runtime.layout``): every rank in
  plain data parallelism; the data-parallel group when model parallelism splits the model (DDP over
  the "dp" dimension of a TP mesh: a TP shard is compared with its dp peers, never its TP peers); no
  rank when nobody else holds it (a pipeline stage's layers with no data-parallel replica).

Names carry no wrapper prefixes (``module.``, ``_orig_mod.``): ``features.0.weight``,
``features.0.weight.grad``, ``features.1.running_mean``, ``optimizer.features.0.weight.momentum_buffer``.

The walk over modules and wrappers happens once (``ReplicaSet``); each check only reads the live
tensors it recorded (and ``.grad``, which the training may replace every step).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from distdebug.fingerprint.compare import split_group, with_group
from distdebug.fingerprint.hostpass import any_none
from distdebug.fingerprint.pending import Run
from distdebug.runtime.discovery import ddp_params, find_ddp, unwrap
from distdebug.runtime.layout import Layout


def model_layout(root: torch.nn.Module) -> tuple[torch.nn.Module, bool, bool]:
    """(inner module, parameters fully sharded?, DDP syncs buffers at the start of each forward?)."""
    inner, chain, options = unwrap(root)
    sharded = "fsdp2" in chain or options.get("deepspeed", {}).get("zero_stage") == 3
    ddp_sync = bool(options.get("ddp", {}).get("broadcast_buffers"))
    return inner, sharded, ddp_sync


def _is_zero3_param(p: Any) -> bool:
    return hasattr(p, "ds_id")


class ReplicaSet:
    """The replicated tensors of a rank's models and optimizers, found once and read at every check."""

    def __init__(self, roots: list[torch.nn.Module], optimizers: list[Any], layout: Layout) -> None:
        self.layout = layout
        self.params: list[tuple[str, torch.nn.Parameter]] = []  # compared with .grad, named with group suffix
        self.buffers: list[tuple[str, torch.Tensor]] = []
        self.forward_modules: list[tuple[str, torch.nn.Module, list[str]]] = []  # (prefix, module, param names)
        self.ddp_sync = False
        self._opt_names: dict[int, str] = {}  # id(param) -> name used for its optimizer state
        self._optimizers: list[weakref.ref[Any]] = []  # weak: the user's optimizer is never kept alive
        self._grad_names: dict[str, str] = {}  # a parameter's name -> its gradient's
        self._state_labels: dict[tuple[str, Any, type], str] = {}  # optimizer state -> name ("": not compared)
        many = len(roots) > 1
        deepspeed = False
        for i, root in enumerate(roots):
            inner, sharded, ddp_sync = model_layout(root)
            self.ddp_sync |= ddp_sync
            deepspeed |= "deepspeed" in unwrap(root)[1]
            prefix = f"{type(inner).__name__}[{i}]." if many else ""
            for n, b in inner.named_buffers():
                group = layout.replicas(b)
                if group is not False:
                    self.buffers.append((with_group(prefix + n, group), b))
            ddp = find_ddp(root)
            # TP inside DDP: the parameters DDP reduces, as noted at its construction (runtime.layout)
            hidden = {n: p for n, p in (ddp_params(ddp) or [])} if ddp is not None else {}
            listed = {n for n, _ in inner.named_parameters()}
            for name, p in hidden.items():
                if name not in listed and isinstance(p, torch.nn.Parameter):
                    group = layout.replicas(p)
                    if group is not False:
                        self.params.append((with_group(prefix + name, group), p))
                        self._opt_names[id(p)] = prefix + name
            for mod_name, mod in inner.named_modules():
                direct = []
                for pname, p in mod.named_parameters(recurse=False):
                    name = prefix + (f"{mod_name}.{pname}" if mod_name else pname)
                    group = layout.replicas(p)
                    if sharded and (group is False or _is_zero3_param(p)):
                        direct.append(pname)  # fully sharded: compared unsharded, in forward
                        continue
                    if group is False:
                        continue  # no other rank holds it (a TP shard, a pipeline stage's own layer)
                    if sharded and not hasattr(p, "placements") and not _is_zero3_param(p):
                        continue  # a sharded model's odd plain parameter: nothing known about it
                    self.params.append((with_group(name, group), p))
                    self._opt_names[id(p)] = name
                if direct:
                    self.forward_modules.append((prefix + (f"{mod_name}." if mod_name else ""), mod, direct))
        if not deepspeed:  # ZeRO partitions optimizer state across ranks
            self._optimizers = [weakref.ref(o) for o in optimizers if isinstance(o, torch.optim.Optimizer)]
        # The parameters, their names, and the names with each gradient beside its parameter: every check's
        self._plist: list[torch.Tensor] = [p for _, p in self.params]
        self._pnames = [n for n, _ in self.params]
        self._both = [n for name in self._pnames for n in (name, self._grad_name(name))]

    def tensors(self, with_state: bool = True) -> tuple[list[str], list[Run]]:
        """Parameters, reduced gradients and optimizer state (buffers apart: see ``ddp_sync``): their names, and
        the tensors as runs (``fingerprint.pending.Run``: a list of tensors and the slice of the names it fills),
        the parameters one run, their gradients another, the optimizer's state a third; ``with_state`` False:
        the parameters only. The names keep each gradient beside its parameter (the order a divergence is told
        in); the runs keep each list the same objects every step, so the host's fingerprints reuse the
        parameters' plan (``fingerprint.many``) while the gradients, new every step, are planned alone."""
        # Called every checked step (every step by default) for a thousand tensors and more: the names and
        # groups, the same every step, are worked out once (issue 18: this was a third of the fingerprints'
        # time). No (name, tensor) pair a tensor (issue 62: pairs made by the thousand every step were what the
        # interpreter's collector caught and promoted), and no list of parameters and gradients mixed: a new
        # list every step, whose parameters' plan was made again every step (1.3 us a tensor against 0.3).
        params, n = self._plist, len(self._plist)
        if not with_state:
            return self._pnames, [Run(slice(0, n), params)]
        grads = [p.grad for p in params]
        if not any_none(grads):  # every gradient there: the names of every step
            names = self._both
            runs = [Run(slice(0, 2 * n, 2), params), Run(slice(1, 2 * n, 2), grads, params)]
        else:  # some parameters without a gradient (frozen, unused this step)
            names = []
            mixed: list[torch.Tensor] = []
            for name, p, g in zip(self._pnames, params, grads, strict=True):
                names.append(name)
                mixed.append(p)
                if g is not None:
                    names.append(self._grad_name(name))
                    mixed.append(g)
            runs = [Run(slice(0, len(names)), mixed)]
        state_names, state = self._state()
        if state:
            runs.append(Run(slice(len(names), len(names) + len(state)), state))
            names = names + state_names
        return names, runs

    def _grad_name(self, name: str) -> str:
        gname = self._grad_names.get(name)
        if gname is None:
            base, group = split_group(name)
            gname = self._grad_names[name] = with_group(base + ".grad", group)
        return gname

    def _state(self) -> tuple[list[str], list[torch.Tensor]]:
        """The optimizer state's tensors that are replicas, and their names."""
        names: list[str] = []
        out: list[torch.Tensor] = []
        labels = self._state_labels
        for ref in self._optimizers:
            opt = ref()
            if opt is None:
                continue
            for param, state in opt.state.items():
                pname = self._opt_names.get(id(param))
                if pname is None:
                    continue
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        cached = (pname, key, type(value))
                        label = labels.get(cached)
                        if label is None:
                            if len(labels) > 4 * len(self._opt_names) + 64:
                                labels.clear()  # bounded whatever the optimizer keeps
                            value_group = self.layout.replicas(value)
                            label = labels[cached] = ("" if value_group is False else
                                                      with_group(f"optimizer.{pname}.{key}", value_group))
                        if label:
                            names.append(label)
                            out.append(value)
        return names, out

    def unsharded(self, prefix: str, module: torch.nn.Module, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        """A fully sharded module's parameters as the forward sees them (gathered), or [] if they are not.
        Under FSDP2 x TP a gathered parameter is still its TP shard: compared within its replica group."""
        out = []
        for pname in names:
            p = module._parameters.get(pname)
            group = self.layout.replicas(p) if p is not None else False
            if p is None or group is False:
                continue  # still a shard: the framework has not gathered it (yet)
            numel = getattr(p, "ds_numel", None)
            data = p.data
            if numel is not None and data.numel() != numel:
                continue  # ZeRO-3 partition, not gathered
            out.append((with_group(prefix + pname, group), data))
        return out


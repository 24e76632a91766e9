"""Describing what discovery found: how a model is wrapped, what an optimizer is, the process group.

All functions take live objects and return plain dicts (JSON-ready) so that the event stream
records them and detectors can read them. deepspeed is never imported here: an engine is told by
its class's module and methods, so a DeepSpeed-free environment pays nothing.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor in a module's inputs or outputs (nested tuples, lists, dicts), depth first."""
    if isinstance(obj, torch.Tensor):
        return obj
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for x in items:
        t = first_tensor(x)
        if t is not None:
            return t
    return None


def is_deepspeed_engine(module: Any) -> bool:
    cls = type(module)
    return cls.__module__.startswith("deepspeed") and hasattr(module, "zero_optimization_stage")


def unwrap(module: torch.nn.Module) -> tuple[torch.nn.Module, list[str], dict[str, Any]]:
    """Peel wrappers off a root module: returns (inner module, wrapper chain outermost first, options)."""
    from torch.nn.parallel import DistributedDataParallel

    chain: list[str] = []
    options: dict[str, Any] = {}
    m: Any = module
    for _ in range(8):  # wrappers nest a few levels at most; the bound stops cycles
        if type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod"):
            chain.append("torch.compile")
            m = m._orig_mod
        elif isinstance(m, DistributedDataParallel):
            chain.append("ddp")
            options["ddp"] = {
                # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (same meaning).
                "broadcast_buffers": bool(getattr(m, "forward_sync_buffers", getattr(m, "broadcast_buffers", True))),
                "find_unused_parameters": bool(m.find_unused_parameters),
                "gradient_as_bucket_view": bool(m.gradient_as_bucket_view),
                "static_graph": bool(getattr(m, "static_graph", False)),
                "bucket_cap_bytes": int(getattr(m, "bucket_bytes_cap", 0)),
                "device_ids": [str(d) for d in (m.device_ids or [])],
            }
            m = m.module
        elif is_deepspeed_engine(m):
            chain.append("deepspeed")
            options["deepspeed"] = {
                "zero_stage": int(m.zero_optimization_stage()),
                "gradient_accumulation_steps": int(m.gradient_accumulation_steps()),
                "train_micro_batch_size_per_gpu": int(m.train_micro_batch_size_per_gpu()),
            }
            m = m.module
        else:
            break
    # FSDP2's module is looked up, never imported: a script that has not imported torch.distributed.fsdp has
    # no FSDPModule, and importing it (with DTensor) costs every rank about a second of CPU at startup.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    FSDPModule = getattr(fsdp, "FSDPModule", None)
    if FSDPModule is not None and isinstance(m, FSDPModule):
        chain.append("fsdp2")
        options["fsdp2"] = {"class": next(
            (b.__name__ for b in type(m).__bases__ if b is not FSDPModule), type(m).__name__)}
    return m, chain, options


_COMPILED: dict[int, Any] = {}  # id(module) -> weakref, for modules that run inside a compiled region
_DDP_BUILT: list[Any] = []  # weakrefs to the DistributedDataParallel wrappers built in this process


def note_ddp(ddp: Any) -> None:
    """A DDP wrapper was built (runtime.patches watches its constructor): kept weakly, a few."""
    _DDP_BUILT[:] = [r for r in _DDP_BUILT if r() is not None][-7:] + [weakref.ref(ddp)]


_DDP_PARAMS: weakref.WeakKeyDictionary[Any, list[tuple[str, weakref.ref[Any]]]] = weakref.WeakKeyDictionary()
"""Each DDP wrapper's parameters by name, noted at its construction: with TP inside DDP
(``DDP(model, device_mesh=mesh["dp"])``) torch turns the DTensor parameters into local ones before
wrapping and back around each forward, and after the first forward ``named_parameters()`` of the inner
module no longer lists them (torch.distributed.tensor.parallel.ddp). Held weakly."""


def note_ddp_params(ddp: Any) -> None:
    """Right after DDP's constructor: the parameters it reduces, by the names the user wrote."""
    module = getattr(ddp, "module", None)
    if module is not None:
        _DDP_PARAMS[ddp] = [(n, weakref.ref(p)) for n, p in module.named_parameters()]


FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning", "lightning_fabric")
"""Training frameworks that build the DDP wrapper themselves: the user sets its options through theirs."""

_DDP_BUILDER: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def note_ddp_builder(ddp: Any, frame: Any) -> None:
    """Which framework built ``ddp`` (called in its constructor, ``frame`` the constructor's caller): the
    outermost one on the stack, closest to the script (the HF Trainer builds it through accelerate's
    ``prepare``: the Trainer's options are the ones the user writes). Nothing is kept for a script's own."""
    found = None
    depth = 0
    while frame is not None and depth < 200:
        top = str(frame.f_globals.get("__name__", "")).split(".", 1)[0]
        if top in FRAMEWORKS:
            found = top
        frame = frame.f_back
        depth += 1
    if found is not None:
        _DDP_BUILDER[ddp] = found


def ddp_builder(ddp: Any) -> str | None:
    """The framework that built ``ddp`` (one of FRAMEWORKS), or None: the script built it."""
    return _DDP_BUILDER.get(ddp)


def ddp_params(ddp: Any) -> list[tuple[str, Any]] | None:
    """The parameters noted at ``ddp``'s construction that are still alive, or None if none were noted."""
    noted = _DDP_PARAMS.get(ddp)
    if noted is None:
        return None
    return [(n, p) for n, ref in noted if (p := ref()) is not None]


def ddp_exists() -> bool:
    """Whether a DDP wrapper built in this process is alive: when its gradients still differ across
    ranks, DDP reduced nothing for them (its hooks lost, or the forward ran on the unwrapped module)."""
    return any(r() is not None for r in _DDP_BUILT)


def mark_compiled(roots: list[Any]) -> None:
    """Note every module that runs inside a torch.compile'd region: the subtree of a compiled
    wrapper (``torch.compile(m)``'s OptimizedModule) and of a module compiled in place
    (``m.compile()``, per-block compile). Hooks on them would be traced into the compiled graph,
    and adding, removing or flipping one (a flag it reads) recompiles it: the harness never hooks
    them (``runs_compiled``)."""

    def mark(m: Any) -> None:
        for sub in m.modules():
            _COMPILED[id(sub)] = weakref.ref(sub)

    for root in roots:
        for m in root.modules():
            if type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod"):
                mark(m._orig_mod)
            elif getattr(m, "_compiled_call_impl", None) is not None:
                mark(m)


def any_compiled() -> bool:
    return any(ref() is not None for ref in _COMPILED.values())


def runs_compiled(module: Any) -> bool:
    ref = _COMPILED.get(id(module))
    return ref is not None and ref() is module


def accumulating(ddps: list[Any]) -> bool:
    """Every DDP wrapper given is inside ``no_sync()`` (gradient accumulation, accelerate's and
    Lightning's included): the running backward reduces nothing and its gradients are not the step's
    yet. Readers of the step's gradients wait for the backward that syncs: the gradients keep
    accumulating into it, and a NaN or Inf stays one (issue 18: one pass per step, not per micro-batch)."""
    return bool(ddps) and all(not getattr(d, "require_backward_grad_sync", True) for d in ddps)


def find_ddp(module: Any) -> Any:
    """The DistributedDataParallel wrapper anywhere in a root's wrapper chain (``torch.compile(DDP(m))``
    puts it under the compiled module), or None."""
    from torch.nn.parallel import DistributedDataParallel

    m = module
    for _ in range(8):
        if isinstance(m, DistributedDataParallel):
            return m
        inner = getattr(m, "_orig_mod", None) if type(m).__name__ == "OptimizedModule" else None
        if inner is None:
            return None
        m = inner
    return None


def is_model(module: torch.nn.Module) -> bool:
    """A root module worth tracking: loss functions and parameter-free modules are not models."""
    if isinstance(module, torch.nn.modules.loss._Loss):
        return False
    return is_deepspeed_engine(module) or next(module.parameters(), None) is not None


def _param_count(params: Any) -> tuple[int, int]:
    """(elements, bytes) of the full model, whatever the sharding (DTensor, ZeRO-3 partitions, TP
    parameters DDP localised: their spec keeps the full shape)."""
    import math

    n = 0
    nbytes = 0
    for p in params:
        spec = getattr(p, "_st_info", None)  # a TP parameter inside DDP (runtime.layout)
        full = getattr(spec, "shape", None)
        numel = int(getattr(p, "ds_numel", 0) or (math.prod(full) if full is not None else p.numel()))
        n += numel
        nbytes += numel * p.element_size()
    return n, nbytes


def describe_model(root: torch.nn.Module, manual_grad_collectives: bool = False) -> dict[str, Any]:
    inner, chain, options = unwrap(root)
    bn = [
        name for name, mod in inner.named_modules()
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)
    ]
    sync_bn = [name for name, mod in inner.named_modules() if isinstance(mod, torch.nn.SyncBatchNorm)]
    ddp = find_ddp(root)
    noted = ddp_params(ddp) if ddp is not None else None
    params = [p for _, p in noted] if noted else list(inner.parameters())
    n, nbytes = _param_count(params)
    labels = [
        f"deepspeed-zero{options['deepspeed']['zero_stage']}" if w == "deepspeed" else w for w in chain
    ]
    if chain:
        wrapper = "+".join(labels)
    elif manual_grad_collectives:
        wrapper = "manual"  # plain module whose gradients the script all-reduces itself
    else:
        wrapper = "plain"
    return {
        # fully_shard swaps the class for a generated FSDP<Name>; report the user's class name.
        "class": options.get("fsdp2", {}).get("class", type(inner).__name__),
        "wrapper": wrapper,
        "wrappers": chain,
        "options": options,
        "parameters": n,
        "parameter_bytes": nbytes,
        "parameter_tensors": len(params),  # the shape of the harness's host cost (analysis.costmodel)
        "modules": sum(1 for _ in inner.modules()),
        "batchnorm_modules": len(bn),
        "syncbatchnorm_modules": len(sync_bn),
    }


def describe_optimizer(opt: torch.optim.Optimizer) -> dict[str, Any]:
    groups = opt.param_groups
    return {
        "class": type(opt).__name__,
        "param_groups": len(groups),
        "parameters": sum(len(g["params"]) for g in groups),
        "lr": float(groups[0]["lr"]) if groups and "lr" in groups[0] else None,
    }


def describe_process_group() -> dict[str, Any] | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return {
        "backend": str(dist.get_backend()),
        "world_size": dist.get_world_size(),
        "rank": dist.get_rank(),
    }

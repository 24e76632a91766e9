"""Which tensors are replicas (must be bitwise equal across data-parallel ranks), named as the user wrote them.

- DDP, a plain module with hand-written all-reduce, DeepSpeed ZeRO-1/2: parameters, gradients after
  reduction, buffers and optimizer state (ZeRO partitions its optimizer state: left out there).
- FSDP2 ``fully_shard`` and ZeRO-3: parameters, gradients and optimizer state are shards that differ
  by design and are never compared; buffers are replicated and are.

Names carry no wrapper prefixes (``module.``, ``_orig_mod.``): ``features.0.weight``,
``features.0.weight.grad``, ``features.1.running_mean``, ``optimizer.features.0.weight.momentum_buffer``.
"""

from __future__ import annotations

from typing import Any

import torch

from distdebug.runtime.discovery import unwrap


def model_layout(root: torch.nn.Module) -> tuple[torch.nn.Module, bool, bool]:
    """(inner module, parameters fully sharded?, DDP syncs buffers at the start of each forward?)."""
    inner, chain, options = unwrap(root)
    sharded = "fsdp2" in chain or options.get("deepspeed", {}).get("zero_stage") == 3
    ddp_sync = bool(options.get("ddp", {}).get("broadcast_buffers"))
    return inner, sharded, ddp_sync


def replicated_params(roots: list[torch.nn.Module], optimizers: list[Any]) -> list[tuple[str, torch.Tensor]]:
    """Parameters, reduced gradients and optimizer state that every data-parallel rank must hold equally."""
    out: list[tuple[str, torch.Tensor]] = []
    names: dict[int, str] = {}
    many = len(roots) > 1
    sharded_any = False
    for i, root in enumerate(roots):
        inner, sharded, _ = model_layout(root)
        sharded_any |= sharded or "deepspeed" in unwrap(root)[1]
        prefix = f"{type(inner).__name__}[{i}]." if many else ""
        for name, p in inner.named_parameters():
            names[id(p)] = prefix + name
            if sharded:
                continue
            out.append((prefix + name, p))
            if p.grad is not None:
                out.append((f"{prefix}{name}.grad", p.grad))
    if not sharded_any:
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                continue
            for param, state in opt.state.items():
                pname = names.get(id(param))
                if pname is None:
                    continue
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        out.append((f"optimizer.{pname}.{key}", value))
    return out


def replicated_buffers(roots: list[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    many = len(roots) > 1
    for i, root in enumerate(roots):
        inner, _, _ = model_layout(root)
        prefix = f"{type(inner).__name__}[{i}]." if many else ""
        out.extend((prefix + name, b) for name, b in inner.named_buffers())
    return out

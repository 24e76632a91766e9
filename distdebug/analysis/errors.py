"""The script's own error, read as a diagnosis: out of memory (and where), and the configuration
traps that PyTorch and DeepSpeed only reveal by raising.

The runtime half of ``distdebug lint`` for the checks whose only runtime sign is an exception:
DDP with parameters that get no gradient (``find_unused_parameters=False``), ``static_graph=True``
with a graph that changes, ``detach_()`` on gradients that are views of DDP's buckets
(``gradient_as_bucket_view=True``), device_ids that do not fit the module, DeepSpeed's batch
arithmetic. Each becomes a finding on the rank that raised, with the step, the subject and the
fix, instead of a wall of C++ text. The error texts matched are PyTorch's and DeepSpeed's own
(reducer.cpp, VariableTypeUtils, DeepSpeed's config check); the bootstrap adds what only the live
objects know (the names of the parameters that got no gradient). Pure functions on the
``script_error`` record.
"""

from __future__ import annotations

import re
from typing import Any

from distdebug.findings import Finding, Severity


def oom_phase(stack: list[dict[str, Any]]) -> str:
    """forward, backward or step: where in the training step an out-of-memory error was raised.

    Read from the script's frames, innermost first: the first frame that calls backward() or
    step() (or is a function of that name) decides; otherwise it is the forward.
    """
    for frame in reversed(stack or []):
        code, func = frame.get("code") or "", frame.get("func") or ""
        if func == "backward" or ".backward(" in code:
            return "backward"
        if func == "step" or re.search(r"\.step\(", code):
            return "step"
    return "forward"


def unused_indices(message: str) -> dict[int, list[int]]:
    """DDP's "Parameter indices which did not receive grad for rank R: i j k", per rank."""
    return {int(r): [int(i) for i in idx.split()]
            for r, idx in re.findall(r"did not receive grad for rank (\d+):\s*([\d ]+)", message)}


def error_findings(rank: int, error: dict[str, Any]) -> list[Finding]:
    """Findings for one rank's ``script_error`` record; none when the error is not one we know."""
    name, message = str(error.get("exception") or ""), str(error.get("message") or "")
    first = message.strip().splitlines()[0][:200] if message.strip() else ""
    step = int(error.get("step") or 0) + 1  # the record counts the steps completed before the error

    def finding(detector: str, subject: str, text: str, fix: str, **evidence: Any) -> list[Finding]:
        # ``raised``: the rank died of it (the causal model's "crash": the hang it leaves the others in follows)
        return [Finding(severity=Severity.CRITICAL if detector == "oom" else Severity.ERROR, detector=detector,
                        ranks=[rank], step=step, subject=subject, message=text, evidence={**evidence, "raised": True},
                        fix=fix)]

    if "OutOfMemory" in name or "out of memory" in message.lower():
        phase = oom_phase(error.get("stack") or [])
        return finding("oom", f"out of memory in {phase}",
                       f"rank {rank} ran out of memory in the {phase} ({name}: {first})",
                       "activation checkpointing, shorter sequences or smaller micro-batches" if phase == "forward"
                       else "shard gradients and optimizer state (ZeRO, FSDP), or smaller micro-batches",
                       phase=phase, exception=name)
    if "Can't detach views in-place" in message and "gradient_as_bucket_view" in message:
        return finding("config_lint", "gradient_as_bucket_view",
                       "detach_() on a gradient that is a view of DDP's bucket (gradient_as_bucket_view=True): "
                       "PyTorch refuses it",
                       "zero gradients with optimizer.zero_grad() (set_to_none) or p.grad = None instead of "
                       "p.grad.detach_(); or drop gradient_as_bucket_view. In-place clipping is fine.")
    if "graph has changed" in message and "static_graph" in message:  # both of DDP's wordings
        return finding("config_lint", "static_graph",
                       "DDP(static_graph=True) but the graph changed between iterations: a parameter used in one "
                       "iteration went unused in another, or the reverse (a data-dependent branch)",
                       "static_graph=False (with find_unused_parameters=True if some parameters are unused on some "
                       "steps), or make every iteration use the same parameters")
    if "Expected to have finished reduction in the prior iteration" in message:
        names = error.get("unused_parameters") or {}
        indices = unused_indices(message)
        mine = names.get(str(rank)) or names.get(rank) or indices.get(rank) or next(iter(indices.values()), [])
        what = ", ".join(str(n) for n in mine[:8]) + ("..." if len(mine) > 8 else "")
        return finding("config_lint", "find_unused_parameters",
                       "DDP parameters got no gradient in a step (find_unused_parameters=False)"
                       + (f": {what}" if what else ""),
                       "make every parameter take part in the loss (or freeze it: requires_grad=False), or "
                       "DDP(find_unused_parameters=True) if they are unused only on some steps",
                       unused=[str(n) for n in mine])
    if "device_ids and output_device arguments only work with" in message:
        return finding("config_lint", "device_ids",
                       f"DDP was given device_ids/output_device that do not fit the module: {first}",
                       "on GPU: model.to(local_rank) first, then DDP(model, device_ids=[local_rank], "
                       "output_device=local_rank); on CPU or for a multi-device module: no device_ids, no "
                       "output_device")
    m = re.search(r"train_batch_size is not equal to micro_batch_per_gpu \* gradient_acc_step \* world_size "
                  r"(\d+) != (\d+) \* (\d+) \* (\d+)", message)
    if m:
        total, micro, acc, world = (int(x) for x in m.groups())
        return finding("config_lint", "train_batch_size",
                       f"DeepSpeed batch arithmetic: train_batch_size {total} != micro batch {micro} x "
                       f"accumulation {acc} x world size {world} = {micro * acc * world}",
                       "set two of train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps "
                       "and let DeepSpeed derive the third (it depends on the world size)",
                       train_batch_size=total, micro=micro, accumulation=acc, world=world)
    return []

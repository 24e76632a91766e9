"""oom: a rank that ran out of memory, placed in its forward, backward or optimizer step."""

from __future__ import annotations

from distdebug.cards.base import OOM, OOM_FORWARD, Card, Variant

_CHECK = "the memory column of the rank that failed: which part grew"

CARD = Card(
    code="DD403", name="oom", family="performance", source="the launcher, from a rank's error after it failed",
    title="a rank ran out of memory: in forward (activations), backward or the optimizer step (gradients and state)",
    severities=("critical",),
    meaning="A rank's script raised an out-of-memory error. Its stack says where: in the forward the activations "
            "did not fit; in backward or the optimizer step, the gradients and optimizer state.",
    subjects="`out of memory in forward`, `... in backward` or `... in step`",
    causes=("activations (forward): long sequences, large micro-batches", "gradients and optimizer state "
            "(backward, step): a model too large for unsharded state"),
    check="the memory column of the rank that failed: which part grew",
    fix="forward: activation checkpointing, shorter sequences or smaller micro-batches; backward/step: shard "
        "gradients and optimizer state (ZeRO, FSDP), activation checkpointing",
    kind="crash", noun="the out-of-memory error",
    variants=(
        Variant("in the forward (evidence phase: forward)", OOM_FORWARD, "activations (forward)", _CHECK,
                "activation checkpointing, shorter sequences or smaller micro-batches",
                when=lambda f, c: (f.evidence or {}).get("phase") == "forward"),
        Variant("in backward or the optimizer step", OOM, "gradients and optimizer state (backward/step), with the "
                "activations saved for backward", _CHECK,
                "ZeRO/FSDP sharding of gradients and optimizer state, activation checkpointing, or smaller "
                "micro-batches",
                when=lambda f, c: (f.evidence or {}).get("phase") in ("backward", "step")),
        Variant("phase unknown", OOM, "activations or optimizer state", _CHECK,
                "ZeRO/FSDP sharding of gradients and optimizer state, or smaller micro-batches"),
    ),
)

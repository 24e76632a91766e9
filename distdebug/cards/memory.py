"""memory: bytes per rank in parameters, gradients, optimizer state and activations."""

from __future__ import annotations

from distdebug.cards.base import NOTE, Card, Variant

CARD = Card(
    code="DD402", name="memory", family="performance", source="detector (at steps 1, 2, 4, 8, then every 16)",
    title="bytes per rank in parameters, gradients, optimizer state, activations, other; per step, at peak",
    severities=("info",),
    meaning="Where a rank's memory goes: parameters, gradients, optimizer state, activations saved for backward, "
            "and the rest, at the checked steps and at the peak. A note that says which part is largest, so an "
            "out-of-memory can be planned for.",
    subjects="the largest part (`activations`, `optimizer state`, ...)",
    causes=("activations (long sequences, large micro-batches)", "optimizer state (Adam keeps two copies)"),
    check="the memory column: parameters / gradients / optimizer state / activations",
    fix="activation checkpointing, smaller micro-batches or shorter sequences; ZeRO/FSDP for state",
    kind="other", noun="the memory use",
    cost="reads the allocator's counters and the saved tensors of one forward at the checked steps",
    variants=(
        Variant("any", NOTE, "where the memory goes: activations, or optimizer state larger than expected",
                "the memory column: parameters / gradients / optimizer state / activations",
                "activation checkpointing, smaller micro-batches or shorter sequences; ZeRO/FSDP for state"),
    ),
)

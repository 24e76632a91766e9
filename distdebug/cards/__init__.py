"""A card per kind of finding: what it means, its causes, the check, the fix, the faults that reproduce it,
its options and cost, its advice per case, and its place in the causal model (kinds.py).

Why here, on the floor just above the ground: the cards are read by the detectors (their one-line
description), the analysis (the incidents' kinds), the report (the advice), the CLI (``distdebug explain``,
``distdebug detectors``) and the docs' generator, and must import neither torch nor any of those. One module a
card; ``CARDS`` is the registry; a test fails when a registered detector or a finding source has no card.
"""

from __future__ import annotations

from distdebug.cards import (
    bn_divergence,
    checkpoint_roundtrip,
    config_lint,
    data_order,
    env_check,
    env_diff,
    hang,
    harness,
    init_seed,
    link_matrix,
    log_volume,
    loss_nonfinite,
    loss_scale,
    loss_spike,
    memory,
    nan_origin,
    oom,
    profiler,
    replica_divergence,
    rerun,
    startup,
    straggler,
    teardown,
)
from distdebug.cards.base import Advice, Card, Context, Option, Variant
from distdebug.findings import Finding

__all__ = ["CARDS", "Advice", "Card", "Context", "Option", "Variant", "advise", "get", "kind_of", "lookup"]

CARDS: dict[str, Card] = {m.CARD.name: m.CARD for m in (
    loss_nonfinite, nan_origin, loss_spike, loss_scale, replica_divergence, bn_divergence, init_seed, data_order,
    checkpoint_roundtrip, rerun, hang, startup, teardown, straggler, memory, oom, profiler, env_check, env_diff,
    link_matrix, config_lint, harness, log_volume)}
"""Every card by name (a finding's ``detector``), in the families' order."""

FAMILIES = {"numerics": "Numerics: NaN, Inf, spikes, loss scaling", "replicas": "Replicas, data and checkpoints",
            "hangs": "Hangs, start-up and exit", "performance": "Speed and memory",
            "environment": "Environment and configuration", "run": "The run and distdebug itself"}


def get(name: str) -> Card | None:
    """The card for a finding's detector name (None: a plugin's detector, which has no card)."""
    return CARDS.get(name)


def lookup(code_or_name: str) -> Card | None:
    """A card by its code (``DD201``, any case) or its name (``replica_divergence``, ``replica-divergence``)."""
    key = code_or_name.strip()
    by_code = {c.code.lower(): c for c in CARDS.values()}
    return by_code.get(key.lower()) or CARDS.get(key.replace("-", "_").lower())


def kind_of(f: Finding) -> str:
    """A finding's causal kind (kinds.py): its card's, ``other`` for a finding without a card."""
    card = CARDS.get(f.detector)
    return card.kind_of(f) if card is not None else "other"


def advise(f: Finding, c: Context | None = None) -> Advice:
    """The advice for one finding in its context (the incident's root); a plugin's finding gets its own fix."""
    card = CARDS.get(f.detector)
    if card is None:
        return Advice("", "", "", f.fix or "")
    return card.advise(f, c)

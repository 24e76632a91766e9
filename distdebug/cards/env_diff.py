"""env_diff: nodes or ranks that run with different software or variables."""

from __future__ import annotations

from distdebug.cards.base import ENVIRONMENT, Card, Variant

CARD = Card(
    code="DD502", name="env_diff", family="environment", source="`distdebug doctor` (every rank reports its "
    "environment)",
    title="ranks or nodes with different torch, CUDA, NCCL or driver versions, or different variables",
    severities=("warning",),
    meaning="Ranks that should run the same software do not: a different torch, CUDA, NCCL or driver version, or "
            "a different value of a variable that matters, on some nodes. Collectives between such ranks can hang "
            "or fail.",
    subjects="the package or variable that differs",
    causes=("nodes from different images", "a module loaded on some nodes only", "a variable set by a per-node "
            "profile"),
    check="`distdebug doctor --nproc-per-node N`: which ranks hold which value",
    fix="one container image and launcher environment everywhere",
    kind="environment", noun="the environment difference",
    cost="doctor only: not run during training",
    variants=(
        Variant("any", ENVIRONMENT,
                "the environment (the usual cause of distributed failures): nodes or ranks run with different "
                "software or variables", "distdebug doctor --nproc-per-node N --bandwidth",
                "one container image and launcher environment everywhere; fix the flagged variable or link"),
    ),
)

"""env_check: a variable with a known-dangerous value in the environment every rank of a node starts with."""

from __future__ import annotations

from distdebug.cards.base import ENVIRONMENT, Card, Variant

CARD = Card(
    code="DD501", name="env_check", family="environment", source="detector (once per node, by its launcher before the "
    "ranks start); the same checks as `distdebug doctor`",
    title="dangerous NCCL_*/TORCH_NCCL_*/GLOO_* variables in the ranks' environment (as distdebug doctor)",
    severities=("info", "warning", "error"),
    meaning="A variable in the environment the node's ranks start with is known to break or slow distributed "
            "training: a socket interface that does not exist, NCCL's error handling switched off (a failed "
            "collective then hangs instead of ending the job), NCCL_DEBUG writing a line per collective, a "
            "transport disabled.",
    subjects="the variable's name (filed under the global rank of the node's local rank 0; the host in the "
             "message)",
    causes=("a launcher or container environment copied from another cluster", "a debugging variable left on"),
    check="`distdebug doctor --nproc-per-node N`",
    fix="fix or unset the flagged variable (the finding says how)",
    kind="environment", noun="the environment variable",
    faults=("bad_env",),
    cost="once per node, before the ranks start: reads the environment and the host's interfaces",
    variants=(
        Variant("any", ENVIRONMENT,
                "the environment (the usual cause of distributed failures): a variable with a known-dangerous value",
                "distdebug doctor --nproc-per-node N --bandwidth",
                "one container image and launcher environment everywhere; fix the flagged variable or link"),
    ),
)

"""env_check: a variable with a known-dangerous value in a rank's environment."""

from __future__ import annotations

from distdebug.cards.base import ENVIRONMENT, Card, Variant

CARD = Card(
    code="DD501", name="env_check", family="environment", source="detector (once, at start on every rank); the "
    "same checks as `distdebug doctor`",
    title="dangerous NCCL_*/TORCH_NCCL_*/GLOO_*/MASTER_* variables in each rank (as distdebug doctor)",
    severities=("info", "warning", "error"),
    meaning="A variable in a rank's environment is known to break or slow distributed training: a socket "
            "interface that does not exist, NCCL's error handling switched off (a failed collective then hangs "
            "instead of ending the job), NCCL_DEBUG writing a line per collective, a transport disabled.",
    subjects="the variable's name",
    causes=("a launcher or container environment copied from another cluster", "a debugging variable left on"),
    check="`distdebug doctor --nproc-per-node N`",
    fix="fix or unset the flagged variable (the finding says how)",
    kind="environment", noun="the environment variable",
    faults=("bad_env",),
    cost="once at start: reads the environment",
    variants=(
        Variant("any", ENVIRONMENT,
                "the environment (the usual cause of distributed failures): a variable with a known-dangerous value",
                "distdebug doctor --nproc-per-node N --bandwidth",
                "one container image and launcher environment everywhere; fix the flagged variable or link"),
    ),
)

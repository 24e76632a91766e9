"""hang: ranks that stopped calling collectives, called different ones, or never met."""

from __future__ import annotations

from distdebug.cards.base import ENVIRONMENT, HANG, Card, Variant

CARD = Card(
    code="DD301", name="hang", family="hangs", source="the launcher's watchdog (no rank progressed for "
    "--stall-timeout), from each rank's in-flight collectives and stacks",
    title="a hang: the rank that stopped calling collectives or called a different one, the collective, the stacks",
    severities=("warning", "critical"),
    meaning="No rank progressed for the stall timeout. The verdict compares each rank's in-flight collectives "
            "(and NCCL's flight recorder where there is one): the rank that is missing from a collective, the one "
            "that called another op or size, or the rank that died and left the others waiting. A rank still busy "
            "in its own code is a stall (warning), not yet a hang.",
    subjects="`collective #N`, the op and process group, `rank R` (a rank that died), `init_process_group`, "
             "`rendezvous`, or a busy stall",
    causes=("a rank-dependent branch around a collective", "a rank that raised or died",
            "collectives with mismatched sizes or order", "ranks that cannot reach each other at start"),
    check="`distdebug report RUN`: the stalled ranks' stacks and the collective each waits in; `distdebug stacks` "
          "while it is stuck",
    fix="make every rank call the same collectives with the same sizes; keep TORCH_NCCL_ASYNC_ERROR_HANDLING on so "
        "NCCL errors end the job instead of hanging",
    kind="hang", noun="the hang",
    faults=("hang",),
    cost="each rank keeps its in-flight collectives in a small shared file; the verdict runs only once stalled",
    variants=(
        Variant("ranks never met in init_process_group", ENVIRONMENT,
                "the environment: ranks that cannot reach each other (address, port, socket interface) or never "
                "reach init_process_group", "distdebug doctor --nproc-per-node N",
                "the same MASTER_ADDR/PORT, world size and a real socket interface on every node",
                when=lambda f, c: f.subject == "init_process_group", own_fix=True),
        Variant("a collective hang, a rank that died, a stall", HANG,
                "{a_rank} stopped calling collectives or called a different one (rank-dependent branch, a rank "
                "that raised or died, mismatched sizes)",
                "distdebug report {run_dir}: the stalled ranks' stacks and the collective each waits in",
                "make every rank call the same collectives with the same sizes; keep TORCH_NCCL_ASYNC_ERROR_HANDLING "
                "on so NCCL errors end the job instead of hanging"),
    ),
)

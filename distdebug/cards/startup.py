"""startup: init_process_group raised the script's own error at start-up (not a connection problem)."""

from __future__ import annotations

from distdebug.cards.base import ENVIRONMENT, Card, Variant

CARD = Card(
    code="DD302", name="startup", family="hangs", source="the launcher's verdict, from the ranks' errors at start-up",
    title="init_process_group raised the script's own error at start-up (a bad argument), not a connection problem",
    severities=("error",),
    meaning="init_process_group raised on some ranks before any collective ran, and the error is the script's "
            "own (a bad argument, a wrong backend, a world size that does not match), not ranks that cannot reach "
            "each other (that is a hang finding on `init_process_group`). The stack names the line.",
    subjects="`init_process_group`",
    causes=("a wrong argument to init_process_group (backend, init_method, world_size, rank)",
            "an environment variable the call reads with a bad value"),
    check="the finding's stacks: the line of the call and the error",
    fix="change the init_process_group call as the error says (the stack names the line)",
    kind="hang", noun="the failed start",
    cost="none on the training: read from the ranks' state after the job",
    variants=(
        Variant("any", ENVIRONMENT,
                "the script's own error in init_process_group on {ranks}, before any collective ran",
                "the finding's stacks: the line of the call and the error",
                "change the init_process_group call as the error says (the stack names the line)", own_fix=True),
    ),
)

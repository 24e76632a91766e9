"""teardown: a job that failed after its last step, at interpreter exit."""

from __future__ import annotations

from distdebug.cards.base import AFTER_END, Card, Variant

CARD = Card(
    code="DD303", name="teardown", family="hangs", source="the launcher, from each rank's end record",
    title="the training completed but the process failed or hung at exit (threads still alive, atexit handlers)",
    severities=("warning",),
    meaning="Every step completed, then the process exited non-zero or hung at exit: threads of a process group "
            "that was not destroyed (gloo/NCCL workers), another library's threads, or an atexit handler.",
    subjects="`interpreter exit`",
    causes=("destroy_process_group() not called after the last collective", "a library's background thread",
            "an atexit handler that blocks"),
    check="the finding's list of what was still alive when the script ended",
    fix="destroy_process_group() after the last collective",
    kind="other", noun="the failure at exit",
    cost="none on the training",
    variants=(
        Variant("any", AFTER_END,
                "a thread still running when the interpreter exited (gloo/NCCL workers of a process group that was "
                "not destroyed, or another library's), or an atexit handler: the training itself completed",
                "the finding's list of what was still alive when the script ended",
                "destroy_process_group() after the last collective", own_fix=True),
    ),
)

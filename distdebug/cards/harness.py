"""harness: what distdebug itself could not do or see (never the training's fault)."""

from __future__ import annotations

from distdebug.cards.base import HARNESS, Card, Variant

CARD = Card(
    code="DD601", name="harness", family="run", source="distdebug itself, on any rank or in the launcher",
    title="what distdebug could not do or see: a detector that failed and was switched off, a full disk, the "
          "launcher killed",
    severities=("info", "warning", "error"),
    meaning="distdebug's own trouble, said so that a silent gap is never read as health: a detector raised and "
            "was switched off, the run directory's disk filled, the launcher was killed, a check could not run. "
            "The training was not affected; `--fail-on` never counts these.",
    subjects="`detector:NAME`, `launcher`, `run directory`, or what could not be done",
    causes=("a detector's bug on an unusual script", "a full disk", "the launcher killed by the OOM killer or "
            "the scheduler"),
    check="the message; rerun with DISTDEBUG_DEBUG=1",
    fix="report it (what to send: the docs' Contributing page, Reporting a problem); meanwhile "
        "--detectors without that one",
    kind="other", noun="distdebug's own trouble",
    cost="none",
    variants=(
        Variant("a detector failed (subject detector:NAME)", "a distdebug detector failed",
                "distdebug itself (the detector was switched off; training was not affected)",
                "the message; rerun with DISTDEBUG_DEBUG=1",
                "report it (what to send: the docs' Contributing page, Reporting a problem); meanwhile --detectors "
                "without that one",
                when=lambda f, c: f.subject.startswith("detector:")),
        Variant("the launcher died (subject launcher)", "the launcher process died",
                "the launcher was killed (the OOM killer, the scheduler, a signal): its ranks ended themselves so "
                "that none is left behind", "dmesg; the scheduler's log for the launcher's pid",
                "restart the job; give the launcher's node more memory", own_fix=True,
                when=lambda f, c: f.subject == "launcher"),
        Variant("anything else distdebug could not do", HARNESS,
                "the message says (the training was not affected)", "the message", "", own_fix=True),
    ),
)

"""Hang and collective-failure diagnosis: which rank is behind, in which collective, and where it is.

In stages, each a module: ``load`` reads the run directory (each rank's records, its in-flight
collective slot, its crash stack) into ``HangFacts``; ``flight_recorder`` matches the ranks' Flight
Recorder dumps with PyTorch's own analyzer (part of loading); ``judge`` turns the facts into findings,
a pure function tested on facts built by hand and on recorded run directories. ``diagnose`` composes
them; the launcher's supervisor and the pass after the job call it.
"""

from __future__ import annotations

from distdebug.analysis.hang.judge import (
    BUSY_STALL,
    DETECTOR,
    functional_wait,
    is_busy_stall,
    judge,
    rendezvous_incomplete,
    stall_without_culprit,
    user_frame,
    where,
)
from distdebug.analysis.hang.load import HangFacts, RankState, Status, load_facts, rank_states
from distdebug.artifacts.reader import Run
from distdebug.findings import Finding

__all__ = ["BUSY_STALL", "DETECTOR", "HangFacts", "RankState", "Status", "diagnose", "functional_wait",
           "is_busy_stall", "judge", "load_facts", "rank_states", "rendezvous_incomplete", "stall_without_culprit",
           "user_frame", "where"]


def diagnose(run: Run, first_failure: tuple[int, int] | None = None) -> list[Finding]:
    """Findings that explain a hang or a failed collective; empty when nothing is wrong.

    first_failure: (rank, exit code) of the launcher's first failed rank, negative for a signal.
    """
    return judge(load_facts(run, first_failure))

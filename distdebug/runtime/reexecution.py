"""Re-execution: the flags that say a step is being run again on this rank.

A detector that re-runs a step (``detectors.rerun``, ``nan_origin``'s on-demand watch) must not be seen
by the harness as training: while it runs, every detector's hooks and patches pass (``Detector.paused``),
so do the session's own discovery hooks (they read ``replaying``), and an injected fault asks
``replay_step`` for the step it is in. Kept apart from the session so that the rule (flags set for the
length of the re-execution, restored whatever happens in it) is read and tested on its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from distdebug.runtime.cost import one_off
from distdebug.runtime.detector import Detector

REEXECUTION = "re-execution of a step"


class Reexecution:
    """One per session: whether a step is being re-executed, which, and how many have been."""

    def __init__(self) -> None:
        self.replaying = False
        """A step is being re-executed (detectors.rerun, nan_origin's on-demand watch): the session's own
        module hooks pass."""
        self.replay_step: int | None = None
        """The step being re-executed (None: none is): what an injected fault takes for the step it is in."""
        self.replays = 0  # re-executions so far (an injected fault acts once in each execution of its step)

    @contextlib.contextmanager
    def replay(self, step: int) -> Iterator[None]:
        """For the length of a re-execution of ``step`` on this rank: every detector's hooks and patches pass
        (``Detector.paused``), so do the session's own module hooks; injected faults act (their own class
        flag) and see ``step`` as the step they are in (``replay_step``)."""
        paused = Detector.paused
        Detector.paused = True
        self.replaying, self.replay_step = True, step
        self.replays += 1
        try:
            with one_off(REEXECUTION):  # a finding's price, paid once: not the per-step cost (runtime.cost)
                yield
        finally:
            Detector.paused = paused
            self.replaying, self.replay_step = False, None

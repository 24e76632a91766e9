"""The in-job A/B (``attach --measure-overhead``): what the detectors cost this job, where noise cancels.

Two whole runs on a shared machine land up to 40% apart; two neighbouring blocks of steps in one job
see the same machine. So the session switches every detector off and on in alternating blocks of
BLOCK steps, decided from the step number alone (the same steps on every rank: the harness's own
exchange rounds stay matched), and times each step from the end of one step boundary to the end of
the next (a step's forward, backward, update and its own boundary work, all in one mode). Off means
off: hooks and patches pass through (``Detector.paused``), the boundary reads nothing and calls no
detector; the session's own wrappers stay (their cost is in every run's self-accounting,
runtime.cost). Faults act in both modes, and so does checkpoint_roundtrip, whose saves and loads must
pair up.

The first WARM steps are always on (discovery at step 1, first fingerprints); then blocks alternate,
on first. Each finished block is one ``overhead_block`` record: its index, its mode, its step times.
Analysis pairs each on block with the off block after it (analysis.overhead).
"""

from __future__ import annotations

WARM = 2
"""Steps always on before the first block: discovery and the first checks are start-up, not per step."""


def harness_on(step: int, block: int) -> bool:
    """Whether the detectors run in ``step`` (1-based) with blocks of ``block`` steps (0: always)."""
    if block <= 0 or step <= WARM:
        return True
    return ((step - WARM - 1) // block) % 2 == 0


def block_index(step: int, block: int) -> int:
    """The block ``step`` belongs to (-1: the warm-up steps)."""
    return -1 if step <= WARM else (step - WARM - 1) // block


class Blocks:
    """The step times of the block being run (a few floats: one block at a time is kept)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.times: list[float] = []
        self.t_end: float | None = None

    def step_done(self, step: int, now: float) -> dict | None:
        """``step``'s boundary is over at ``now`` (perf_counter): its time is kept; returns the block's
        record fields when ``step`` was its last."""
        t_prev, self.t_end = self.t_end, now
        if step <= WARM or t_prev is None:
            return None
        self.times.append(now - t_prev)
        if (step - WARM) % self.block:
            return None
        times, self.times = self.times, []
        return {"block": block_index(step, self.block), "on": harness_on(step, self.block), "last_step": step,
                "step_times_s": [round(t, 7) for t in times]}

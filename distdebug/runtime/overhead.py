"""The in-job A/B (``attach --measure-overhead``): what the detectors cost this job, where noise cancels.

Two whole runs on a shared machine land up to 40% apart; two neighbouring steps of one job see the same
machine. So the session switches every detector off and on inside the job, in pairs of units of
``unit`` steps (default 4, 8 on CUDA: ``CPU_UNIT``, ``CUDA_UNIT``): in each pair one unit runs with the
detectors and one without, the order drawn per pair from the pair's number alone (the same steps on every
rank: the harness's own exchange rounds stay matched; a drawn order, not a fixed one, so a period in the
script, every other step a gradient-accumulation step or an evaluation, cannot line up with the modes). Pairs of short
units rather than long blocks: the noise of a step time on a loaded machine comes in bursts of a few
steps, and neighbours share them, so the difference within a pair is far less noisy than between long
blocks; not single steps, whose pairs charge what an on step leaves to the next to the off one (CPU_UNIT).

Each step is timed from the end of one step boundary to the end of the next (a step's forward,
backward, update and its own boundary work, all in one mode), twice: wall time, and the CPU time of
the training thread (``time.thread_time``: what the harness's work on the training thread adds, without
the time spent waiting for the other ranks in collectives or for the OS to run this thread: the other
ranks' and the machine's interference removed). Off means off: hooks and patches pass through
(``Detector.paused``), a backward is counted and nothing more (the session keeps no loss and queues no
gradient norms), the boundary reads nothing and calls no detector. What an off step still pays the session
(its counting and its record) is measured apart (``Ledger.off_session_ns``) and added by the analysis: the
difference alone cannot see it, and a run without distdebug does not pay it. Faults act in both modes, and so
does checkpoint_roundtrip, whose saves and loads must pair up.

The first WARM steps are always on (discovery at step 1, first fingerprints). Each finished pair is one
``overhead_block`` record: its index, which unit was on, both units' step times (wall and CPU).
Analysis differences each pair (analysis.overhead).
"""

from __future__ import annotations

WARM = 2
"""Steps always on before the first pair: discovery and the first checks are start-up, not per step."""

_MASK = (1 << 64) - 1


def on_first(pair: int) -> bool:
    """Whether pair ``pair``'s first unit runs with the detectors: one bit of splitmix64 of the pair's number
    (every rank draws the same; no generator of the script's is touched)."""
    z = (pair * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) & 1 == 0


def unit_of(step: int, unit: int) -> tuple[int, int]:
    """(pair, 0 or 1: its first or second unit) of ``step`` (1-based) past the warm-up."""
    return divmod((step - WARM - 1) // unit, 2)


def harness_on(step: int, unit: int) -> bool:
    """Whether the detectors run in ``step`` with units of ``unit`` steps (0: always)."""
    if unit <= 0 or step <= WARM:
        return True
    pair, second = unit_of(step, unit)
    return (second == 0) == on_first(pair)


CUDA_UNIT = 8
"""Steps per unit by default when the job uses CUDA: a step that reads nothing from the device (off) leaves
its device work queued for the next, which then waits for it (a step with the harness's one read); in units
of single steps that backlog would be charged to the harness at every pair, in units of 8 once a unit."""

CPU_UNIT = 4
"""Steps per unit by default otherwise. A step with the harness leaves something to the step after it (the caches
and the allocator it disturbed, the young objects that bring the collector round): with single-step units drawn
in random order, three off steps in four follow an on step and one on step in four does, so the difference is
low by about one and a half times that carry-over (measured, 10 tensors x 1 micro-batch: 0.92 ms a step in
single-step units, 1.02 in units of 4 and of 8, against 1.08 (1.01..1.12) from whole runs against bare
torchrun). In units of 4 the bias is a quarter of that; the pairs are a quarter as many."""


def default_unit(cuda: bool) -> int:
    return CUDA_UNIT if cuda else CPU_UNIT


class Pairs:
    """The step times of the pair being run (a few floats: one pair at a time is kept)."""

    def __init__(self, unit: int) -> None:
        self.unit = unit
        self.times: dict[bool, tuple[list[float], list[float | None]]] = {True: ([], []), False: ([], [])}
        self.t_end: tuple[float, float | None] | None = None
        self.last_step = 0
        self.once = False
        """A step of the pair being run did work once (a re-execution, a profiler window): the pair is said so,
        and left out of the comparison (the steady cost is what it measures; one-offs are counted apart)."""
        self.in_pair = False
        """The steps since the last pair's start were all seen, in order (a step count that jumps, a new
        training phase, drops the pair it fell in)."""

    def step_done(self, step: int, now: float, cpu: float | None, once: bool = False) -> dict | None:
        """``step``'s boundary is over at ``now`` (perf_counter) with the training thread at ``cpu``
        (thread_time; None on a CUDA job, whose backward hooks run on autograd's device threads and whose
        device waits may spin: not this thread's cost); its times are kept; returns the pair's record fields
        when ``step`` was its last."""
        prev, self.t_end = self.t_end, (now, cpu)
        follows, self.last_step = step == self.last_step + 1, step
        if step <= WARM or prev is None:
            return None
        if (step - WARM - 1) % (2 * self.unit) == 0:  # a pair's first step: its time from a boundary in order
            self.in_pair = follows
            self.times = {True: ([], []), False: ([], [])}
            self.once = False
        elif not follows:
            self.in_pair = False
        self.once = self.once or once
        if not self.in_pair:
            return None
        wall, used = self.times[harness_on(step, self.unit)]
        wall.append(now - prev[0])
        used.append(None if cpu is None or prev[1] is None else cpu - prev[1])
        if (step - WARM) % (2 * self.unit):
            return None
        pair, _ = unit_of(step, self.unit)
        (on_s, on_cpu), (off_s, off_cpu) = self.times[True], self.times[False]
        self.times = {True: ([], []), False: ([], [])}
        out: dict = {"block": pair, "on_first": on_first(pair), "last_step": step, "on_s": _r(on_s),
                     "off_s": _r(off_s)}
        if self.once:
            out["one_off"] = True
        if None not in on_cpu and None not in off_cpu:
            out.update(on_cpu_s=_r(on_cpu), off_cpu_s=_r(off_cpu))  # type: ignore[arg-type]
        return out


def _r(xs: list[float]) -> list[float]:
    return [round(x, 7) for x in xs]

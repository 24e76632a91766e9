"""The detector loop: which detectors run, and each call to one of them, guarded and timed.

Why a room of its own: every call the session makes into a detector (set up, attach, before and after a
backward, a step, before the groups go, the end) has the same three rules, and they must hold on every
path: a detector switched off is not called; what it returns is reported; an exception of its own
switches it off on this rank (``Detector.fail``) and never reaches the script. Its time is the
detector's, not the session's (``runtime.cost``). The session decides *when*; this decides *how*.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from time import perf_counter_ns
from typing import Any

from distdebug.findings import Finding
from distdebug.runtime import cost
from distdebug.runtime.detector import Detector


def _overrides(det: Detector, method: str) -> bool:
    """Whether the detector has a method of its own (the base's do nothing: they are not called)."""
    return getattr(type(det), method) is not getattr(Detector, method)


class Dispatch:
    """The rank's detectors and the guarded calls into them."""

    def __init__(self, detectors: Iterable[Detector], ledger: cost.Ledger, report: Callable[[Finding], None],
                 failed: Callable[[str, BaseException, str], None]) -> None:
        self.detectors = list(detectors)
        self.ledger = ledger
        self._report = report
        self._failed = failed
        self._after_backward: list[Detector] = []
        self._on_step: list[Detector] = []

    def run(self, det: Detector, phase: str, call: Callable[[Detector], Any]) -> None:
        """One call into ``det``: its findings reported, an exception of its own switching it off."""
        if det.off:
            return
        try:
            # listed inside the timed region: on_step may be a generator, whose work runs as it is read
            for finding in cost.timed(self.ledger, det.name, lambda d: list(call(d) or ()), det):
                self._report(finding)
        except Exception as e:
            det.fail(e, phase)  # switched off on this rank (hooks removed); training goes on untouched

    def each(self, phase: str, call: Callable[[Detector], Any]) -> None:
        """``call`` on every detector (a copy of the list: one may be switched off meanwhile)."""
        for det in list(self.detectors):
            self.run(det, phase, call)

    def set_up(self, detectors: Iterable[Detector], ctx: Any) -> None:
        """Detectors that start now (the run's, or a new phase's): told where to say a failure, set up."""
        for det in detectors:
            det.on_failure = self._on_failure
            self.run(det, "setup", lambda d: d.setup(ctx))

    def arrange(self) -> None:
        """After the list changed: only the detectors that use it are called after every backward, and at every
        step boundary."""
        self._after_backward = [d for d in self.detectors if _overrides(d, "after_backward")]
        self._on_step = [d for d in self.detectors if _overrides(d, "on_step")]

    def step(self, event: Any) -> None:
        """``on_step(event)`` on every detector that has one, not off or paused: ``run``'s rules, with its
        timing inlined (issue 62: the boundary calls a dozen detectors a step, and the layers of a general call,
        about 5 us each in a real step, were a tenth of the harness's fixed cost)."""
        ledger, claimed, report = self.ledger, cost.claimed, self._report
        for det in list(self._on_step):  # one that fails is taken off the list meanwhile
            if det.off or det.paused:
                continue
            t0 = perf_counter_ns()
            c0 = claimed()
            try:
                out = det.on_step(event)
                if out:  # a generator runs as it is read: inside the timed region
                    for finding in out:
                        report(finding)
            except Exception as e:
                det.fail(e, "on_step")  # switched off on this rank (hooks removed); training goes on untouched
            finally:
                dt = perf_counter_ns() - t0
                ledger.add(det.name, dt - (claimed() - c0), 1)
                cost.give(c0 + dt)

    def after_backward(self) -> None:
        for det in list(self._after_backward):  # one that fails is taken off the list meanwhile
            if not det.off and not det.paused:
                self.run(det, "after_backward", lambda d: d.after_backward())

    def end(self) -> None:
        """The rank's end: every detector finishes and its hooks go."""
        for det in list(self.detectors):
            self.run(det, "on_end", lambda d: d.on_end())
            det.remove_hooks()

    def _on_failure(self, det: Detector, e: BaseException, phase: str) -> None:
        """A detector raised (in a step call, a hook or a patch): it is off on this rank, said once."""
        if det in self.detectors:
            self.detectors.remove(det)
        if det in self._after_backward:
            self._after_backward.remove(det)
        if det in self._on_step:
            self._on_step.remove(det)
        self._failed(det.name, e, phase)

"""Training phases: when the script moves on to a model the detectors never saw.

A script may train several models one after the other in one process (a second ``Trainer.fit`` that
resumes from a checkpoint, the next fold, the next trial). Without phases the harness would go on
watching the old model (unchanged, so every check passes) and see nothing of the training that goes on.
This room keeps what tells a phase (the parameters the detectors watch; an optimizer that steps in a
row without the primary) and how the detectors change over (retired, rebuilt, set up, attached); the
session decides when (runtime.session) and runs the detectors' calls.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from distdebug.context import RankContext
from distdebug.runtime.detector import Detector


class Phases:
    """One per session: the watched parameters, the rival optimizer, and a change of phase in progress."""

    def __init__(self) -> None:
        # The parameters the detectors watch, by id (weakly: an id is reused once its tensor is freed);
        # another optimizer that stepped in a row without the primary.
        self.watched: dict[int, weakref.ref[Any]] = {}
        self.rival: weakref.ref[Any] | None = None
        self.rival_steps = 0
        self.to_attach: list[Detector] | None = None  # detectors of a new phase, attached at its discovery
        self.next_phase: list[Detector] = []  # built when the phase changed; set up after that boundary
        self.order: list[Detector] = []

    def watch(self, parameters: Iterable[Any]) -> None:
        """The parameters the detectors watch from now on (at the end of a discovery step)."""
        self.watched = {}
        for p in parameters:
            if len(self.watched) < 1_000_000:
                self.watched[id(p)] = weakref.ref(p)

    def watches(self, opt: Any) -> bool:
        """Whether ``opt`` updates parameters the detectors watch (its first one tells: an optimizer
        over a model is built from that model's parameters)."""
        try:
            p = opt.param_groups[0]["params"][0]
        except Exception:  # nothing to tell by: stay with what is watched
            return True
        ref = self.watched.get(id(p))
        return ref is not None and ref() is p

    def primary_stepped(self) -> None:
        self.rival = None

    def note_rival(self, opt: Any) -> bool:
        """Another optimizer stepped while the primary is alive. Twice in a row without the primary, over
        parameters nobody watches: the script moved on to a new model and the old one is merely kept alive
        (True: ``opt`` starts a new phase). A GAN's or a critic's optimizers step between the primary's
        steps, over watched parameters."""
        if self.rival is not None and self.rival() is opt:
            self.rival_steps += 1
        else:
            self.rival, self.rival_steps = weakref.ref(opt), 1
        if self.rival_steps >= 2 and not self.watches(opt):
            self.rival = None
            return True
        return False

    def retire(self, detectors: list[Detector], ctx: RankContext, opt: Any) -> list[Detector]:
        """A new phase: ``opt`` trains a model the detectors never saw. The detectors that watch a model are
        retired (hooks removed, patches passed through) and built afresh, with their options and accounting,
        to be set up after this boundary (``pending``) and attached at the next discovery's end. The others,
        and injected faults, go on: a checkpoint saved in one phase is compared when the next restores it.
        Every rank runs the same script, so every rank changes phase at the same step. Returns the detectors
        that go on."""
        retired, fresh, order = [], [], []  # order: the detectors with the fresh ones in the retired's places
        for det in detectors:
            order.append(det)
            if not det.needs_model or det.off:
                continue
            cls = type(det)
            try:
                new = cls(det.config) if cls.Config is not None else cls()  # type: ignore[call-arg]
            except Exception:  # cannot be rebuilt: it stays, watching what it watched
                continue
            new.name = det.name  # type: ignore[misc]
            new.cost_ns, new.cost_calls = det.cost_ns, det.cost_calls  # the run's accounting goes on
            try:
                det.handover(new)
            except Exception:  # nothing passed on: the new one starts as the first phase's did
                pass
            det.off = True
            det.remove_hooks()
            retired.append(det)
            fresh.append(new)
            order[-1] = new
        gone = {id(d) for d in retired}
        lists: list[list[Any]] = [ctx.end_of_backward, ctx.finding_listeners, ctx.communication_observers]
        for callables in lists:  # what the retired detectors registered with the context
            callables[:] = [c for c in callables if id(getattr(c, "__self__", None)) not in gone]
        self.next_phase = fresh
        self.order = order
        ctx.models = []
        ctx.optimizers = [opt]
        return [d for d in detectors if id(d) not in gone]

    @property
    def pending(self) -> bool:
        """A phase changed at this boundary: its fresh detectors wait to be set up."""
        return bool(self.next_phase)

    def take_fresh(self) -> list[Detector]:
        fresh, self.next_phase = self.next_phase, []
        return fresh

    def arrange(self, detectors: list[Detector], fresh: list[Detector]) -> list[Detector]:
        """After the fresh detectors' setup: the detectors in the order of the first phase (injected faults
        first: a fault's hook on a module runs before the detectors' hooks on it, which then see what it
        did), detectors added meanwhile after them. Those that follow phases are detached, to be attached
        again with the fresh ones at the next discovery's end."""
        placed = {id(d) for d in self.order}
        arranged = self.order + [d for d in detectors if id(d) not in placed]
        self.order = []
        again = [d for d in arranged if d.follows_phases and not d.off
                 and (not getattr(d, "acted", False) or getattr(d, "continuing", False))]
        for det in again:
            det.remove_hooks()
        self.to_attach = [d for d in arranged if any(d is x for x in fresh + again)]
        return arranged

    def take_attach(self, detectors: list[Detector]) -> list[Detector]:
        """The detectors to attach at a discovery's end: all of them the first time, then a new phase's."""
        attach, self.to_attach = (detectors if self.to_attach is None else self.to_attach), []
        return attach

"""What a fault is: a small object that runs inside every rank and breaks one thing on purpose, plus
the findings it must cause; and the spec grammar of ``distdebug attach --inject``.

Why faults are detectors to the runtime: a fault needs exactly what a detector gets (a hook before
the script runs, the discovered models and optimizers, every step boundary) and nothing more, so
``distdebug.detectors.base.Detector`` is the interface. It reaches the ranks by import path
(``distdebug.fault_injection.nan_grad:NanGrad``), so distdebug's library never imports this package. Faults run
before the detectors in each rank (their hooks come first), and each writes an ``injected`` record
when it acts: rank, step and what it hit (the parameter, the module, the file), which is what
the replay checks the findings' localisation against.

Spec grammar (``--inject``, repeatable)::

    SPEC   := NAME [ ":" PARAM ( "," PARAM )* ]
    PARAM  := KEY "=" VALUE

``rank`` is the rank the fault acts on (``-1``: every rank), ``step`` the optimizer step it acts in
(1-based; a fault acts from the end of step 1 on, when the models are known, so ``step`` >= 2).
Other keys are per fault (``distdebug faults list``). Values are typed by the fault's parameters;
a bad spec is a one-line error.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from distdebug.artifacts import schema
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.errors import UserError

if TYPE_CHECKING:
    from .facts import Facts


@dataclass(frozen=True)
class Param:
    """One parameter of a fault: its name, type (int, float or str), default and meaning."""

    name: str
    type: type
    default: Any
    help: str


@dataclass(frozen=True)
class Expect:
    """A finding a fault must cause. None: not checked. ``ranks`` is compared as a set."""

    detector: str
    ranks: list[int] | None = None
    step: int | None = None
    subject: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        parts = [self.detector]
        if self.ranks is not None:
            parts.append(f"ranks {sorted(self.ranks)}")
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.subject is not None:
            parts.append(f"subject {self.subject}")
        parts += [f"{k}={v}" for k, v in self.evidence.items()]
        return ", ".join(parts)


@dataclass(frozen=True)
class ParityExpect:
    """What ``distdebug parity`` must say of a candidate with a fault (a fault replayed on a parity recipe): the
    first step it departs at, the first quantity (``grad`` / ``param``: the model's first gradient or parameter;
    else a full ``grad:NAME``), and the class of its likely cause (a key of ``analysis.parity.CAUSES``)."""

    step: int
    quantity: str
    cause: str

    def describe(self) -> str:
        return f"parity departs at step {self.step} at {self.quantity}, likely cause {self.cause}"


class Pace:
    """How long a slow-rank fault (straggler, slow_dataloader) sleeps in each step: ``delay`` seconds at
    least, and at least ``factor`` times the rank's own time per step (its step time less what it slept;
    median of its last WINDOW steps, step 1's start-up left out), at most CAP.

    Why not a fixed delay: the straggler detector judges a rank by its share of the step (relative speed
    score under 0.7: 43 % slower than the fastest), and the step time depends on the machine's load. A
    50 ms sleep doubled a 40 ms step but was 28 % of a 361 ms step when a replay ran two jobs' ranks on 2
    cores (score 0.73: a miss in CI). A sleep as long as the rank's own work makes the rank half as fast
    (score about 0.5) whatever the load, which is the fault the replay means to inject."""

    WINDOW = 5
    CAP = 2.0

    def __init__(self, delay: float, factor: float) -> None:
        self.delay, self.factor = delay, factor
        self.own: deque[float] = deque(maxlen=self.WINDOW)  # recent steps' times less the sleep in them
        self.slept = 0.0  # seconds slept in the step in progress
        self.due = True  # the step in progress has not slept yet

    def now(self) -> float:
        """The sleep for this step: its length the first time it is asked in a step, then 0."""
        if not self.due:
            return 0.0
        own = statistics.median(self.own) if self.own else 0.0
        self.due = False
        self.slept = min(self.CAP, max(self.delay, self.factor * own))
        return self.slept

    def step_ended(self, event: StepEvent) -> None:
        if event.step >= 2:  # step 1 holds the start-up
            self.own.append(max(event.step_time_s - self.slept, 0.0))
        self.slept, self.due = 0.0, True


FACTOR = Param("factor", float, 1.0, "and at least this many times its own time per step (0: `delay` only)")


RANK = Param("rank", int, 1, "the rank it acts on (-1: every rank)")
STEP = Param("step", int, 3, "the optimizer step it acts in (>= 2)")
MODULE = Param("module", str, "", "module name (default: the middle module with parameters)")


class Fault(Detector):
    """Base of every fault. Subclasses set name, description, params, catcher and the engines
    (recipes) the replay runs it on, and override the Detector methods they act from."""

    default: ClassVar[bool] = False
    paused: ClassVar[bool] = False
    follows_phases: ClassVar[bool] = True
    continuing: ClassVar[bool] = False
    """Acts at every step from its step on (a slow rank), not once: attached to a new phase's model even
    after it has acted."""
    """A fault acts whatever the detectors do: never paused by ``--measure-overhead``'s off blocks."""
    params: ClassVar[tuple[Param, ...]] = (RANK, STEP)
    """The spec's parameters; each becomes an attribute of the instance (``rank``, ``step``, ...)."""
    rank: int
    step: int
    catcher: ClassVar[str] = ""
    """The detector that must catch it (for the matrix; may not be built yet: then it is a miss)."""
    engines: ClassVar[tuple[str, ...]] = ("ddp",)
    """Recipes the replay runs it on (keys of fault_injection.matrix.ENGINES)."""
    attach_args: ClassVar[tuple[str, ...]] = ()
    """Extra ``distdebug attach`` options its replay run needs (a short stall timeout for a hang)."""
    exit_codes: ClassVar[tuple[int, ...]] = (0,)
    """Exit codes of a run with this fault that are expected (a hang ends the job with 124)."""
    min_world: ClassVar[int] = 2
    steps: ClassVar[int] = 10
    """Optimizer steps its replay run on a recipe needs (the fault's step and the detector's checks after it)."""

    earliest: ClassVar[int] = 2
    """The earliest step it may act in on a user's script (a loss spike needs the detector's history first)."""
    needs: ClassVar[int] = 1
    """Steps the script must run after the fault's step for its detector to see it (1: the fault never acts
    in the last step); for a fault without a step, the steps of the whole run."""
    acts_through: str = "what it hooks into in the script"
    """What the fault acts through, in words (``the optimizer's step of a float32 parameter``): the end of
    the run says ``nothing it acts through was there (...)`` with it when the fault neither acted nor said
    why not. A fault may set it per instance once it knows its target (a parameter's name)."""

    # ---------------------------------------------------------------- fitting to a user's script
    @classmethod
    def applicable(cls, facts: Facts) -> str:
        """Why this fault cannot act on the probed script, or '' when it can. Subclasses add their own
        reasons (nothing it acts through was there) to these common ones (ranks, steps)."""
        if facts.world < cls.min_world:
            return f"needs {cls.min_world} ranks, the script ran on {facts.world} (give --nproc)"
        rank = next((p.default for p in cls.params if p.name == "rank"), -1)
        if rank >= facts.world:
            return f"acts on rank {rank}, the script ran on {facts.world}"
        least = (cls.earliest if cls.has_step() else 0) + cls.needs
        if facts.steps < least:
            at = f"acts at step {cls.earliest} or later and " if cls.has_step() else ""
            return (f"the script ran {facts.steps} steps; {cls.name} {at}needs {least} steps for "
                    f"{cls.catcher} to see it (run the script longer)")
        return ""

    aims: ClassVar[tuple[int, str] | None] = None
    """What it aims at in the model, fitted from the probe: (0, spec key) the default parameter, (1, spec key)
    the default module, with the rank that holds it (``Facts.aim``)."""

    @classmethod
    def fit(cls, facts: Facts) -> dict[str, Any]:
        """Spec parameters fitted to the script: the step from the number of steps it runs (the default
        when there is room, never at or past the last step), the target (``aims``) and its rank from the
        model; subclasses add their own."""
        out: dict[str, Any] = {}
        if cls.has_step():
            default = next(p.default for p in cls.params if p.name == "step")
            out["step"] = max(cls.earliest, min(default, facts.steps - cls.needs))
        if cls.aims is not None:
            which, key = cls.aims
            rank, target = facts.aim(which) or (1, "")
            out.update(rank=rank, **{key: target})
        return out

    @classmethod
    def has_step(cls) -> bool:
        return any(p.name == "step" for p in cls.params)

    def __init__(self, **params: Any) -> None:
        for p in self.params:
            setattr(self, p.name, params.get(p.name, p.default))
        self.ctx: RankContext | None = None
        self.current = 1  # the step being run now: 1 until the first boundary
        self.acted = False

    # ---------------------------------------------------------------- helpers for subclasses
    def here(self, step: int | None = None) -> bool:
        """This rank, in the fault's step (or ``step``), and not acted yet."""
        return self.mine() and self.current == (self.step if step is None else step) and not self.acted

    def execution(self) -> tuple[int, int]:
        """The step whose computation runs now, and which execution of it: (the step in progress, 0) in the
        training; (the step re-executed, n) while the harness re-executes a step on this rank
        (``Reexecution.replay``: nan_origin's on-demand watch, ``--rerun-on-anomaly``)."""
        from distdebug.runtime.session import current_session

        session = current_session()
        if session is not None and session.reexecution.replay_step is not None:
            return session.reexecution.replay_step, session.reexecution.replays
        return self.current, 0

    def mine(self) -> bool:
        rank = getattr(self, "rank", -1)
        return rank == -1 or (self.ctx is not None and rank == self.ctx.rank)

    def injected(self, **what: Any) -> None:
        """Record that the fault acted (once per step at most); ``step`` defaults to the step in progress."""
        self.acted = True
        if self.ctx is not None and self.ctx.emit is not None:
            self.ctx.emit(schema.INJECTED, **{"fault": self.name, "step": self.current, **what})

    def not_acted(self, reason: str) -> None:
        """Record why the fault did not act, or why what it did was undone before its detector could see
        it (a flipped bit the optimizer rewrote, a spike the loss never saw): one ``not_acted`` record per
        reason and rank. attach's never-acted line and the replay's ``did not act`` verdict quote it: the
        fault knows why, nobody else does."""
        said = self.__dict__.setdefault("_not_acted", set())
        if reason in said or self.ctx is None or self.ctx.emit is None:
            return
        said.add(reason)
        self.ctx.emit(schema.NOT_ACTED, **{"fault": self.name, "step": self.current, "reason": reason})

    def said_why_not(self) -> bool:
        """This rank has recorded a reason (``not_acted``) already."""
        return bool(self.__dict__.get("_not_acted"))

    def targets(self) -> list[int]:
        """The ranks it acts on ([] for every rank)."""
        rank = getattr(self, "rank", -1)
        return [] if rank == -1 else [rank]

    def setup(self, ctx: RankContext) -> None:
        self.ctx = ctx

    def attach(self, ctx: RankContext) -> None:
        self.ctx = ctx

    def on_step(self, event: StepEvent) -> tuple[()]:
        self.current = event.step + 1
        return ()

    def on_end(self) -> tuple[()]:
        """The run is over: a fault that neither acted nor said why on a rank it acts on says so now, so that
        attach and the replay quote a reason rather than guess one. A subclass that overrides this calls it."""
        if self.ctx is None or self.acted or self.said_why_not():
            return ()
        world = self.ctx.identity.world_size
        beyond = [r for r in self.targets() if r >= world]
        if beyond:
            if self.ctx.rank == 0:  # said once for the job: no rank of it is the one the fault acts on
                self.not_acted(f"it acts on rank {beyond[0]}, and the job ran {world} rank{_s(world)} "
                               f"(0-{world - 1})")
            return ()
        if not self.mine():
            return ()
        ran = self.current - 1  # boundaries passed; the step in progress (if any) never ended
        step = getattr(self, "step", None) if self.has_step() else None
        if step is not None and ran < step:
            self.not_acted(f"its step {step} never came: the script ran {ran} step{_s(ran)}")
        else:
            self.not_acted(f"nothing it acts through was there ({self.acts_through})")
        return ()

    # ---------------------------------------------------------------- what the replay checks
    def expect(self, world: int, injected: list[dict[str, Any]]) -> list[Expect]:
        """The findings this fault must cause, given the world size and its ``injected`` records."""
        return [Expect(self.catcher)]

    def parity_expect(self, injected: list[dict[str, Any]]) -> ParityExpect | None:
        """What ``distdebug parity`` must find when the replay runs this fault on a parity recipe (its engines'
        ``parity``), given its ``injected`` records; None: it never acted (or is not replayed there)."""
        return None

    def spec(self) -> str:
        vals = ",".join(f"{p.name}={getattr(self, p.name)}" for p in self.params)
        return f"{self.name}:{vals}" if vals else self.name


class SlowRank(Fault):
    """A fault that makes its rank slow (straggler, slow_dataloader): its ``delay`` and ``factor`` parameters
    drive one ``Pace``, which learns the rank's own step time at every step boundary; ``lag()`` sleeps this
    step's share once and records the first time it acts."""

    delay: float
    factor: float

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.pace = Pace(self.delay, self.factor)

    def lag(self) -> None:
        delay = self.pace.now()
        if delay and not self.acted:
            self.injected(delay=round(delay, 4))
        time.sleep(delay)

    def on_step(self, event: StepEvent) -> tuple[()]:
        self.pace.step_ended(event)
        return super().on_step(event)


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def parse_spec(spec: str, known: dict[str, type[Fault]]) -> tuple[type[Fault], dict[str, Any]]:
    """``NAME[:k=v,...]`` -> (fault class, typed parameters). UserError on anything wrong."""
    name, _, rest = spec.strip().partition(":")
    cls = known.get(name)
    if cls is None:
        raise UserError(f"unknown fault '{name}' in --inject {spec}; known: {', '.join(sorted(known))} "
                        "(see: distdebug faults list)", 2)
    declared = {p.name: p for p in cls.params}
    params: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise UserError(f"--inject {spec}: '{item}' is not KEY=VALUE (grammar: NAME[:KEY=VALUE,...])", 2)
        p = declared.get(key)
        if p is None:
            raise UserError(f"--inject {spec}: fault {name} has no parameter '{key}'; it takes "
                            f"{', '.join(declared) or 'none'}", 2)
        try:
            params[key] = p.type(value)
        except ValueError:
            raise UserError(f"--inject {spec}: {key} must be {p.type.__name__}, got '{value}'", 2) from None
    if "step" in declared and params.get("step", declared["step"].default) < 2:
        raise UserError(f"--inject {spec}: step must be 2 or more (faults act once the models are known, "
                        "after step 1)", 2)
    return cls, params

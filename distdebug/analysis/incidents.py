"""Incidents: the findings that share a cause, as one problem with one fix, the root cause first.

Why: one cause shows in several detectors. DDP's ``broadcast_buffers=False`` with BatchNorm is a
configuration warning at step 1, a ``bn_divergence`` error on ``body.1`` at step 2 and a
``replica_divergence`` error on ``body.1.running_mean`` at step 4: three rows, sorted by severity, the
cause last. A NaN born on rank 1 is its ``nan_origin`` error, a ``loss_nonfinite`` error on every rank
(the all-reduce spread it), the loss scaler's skipped step, the other ranks' "received" warnings.

The rule is the causal model's table of what can cause what (``cards.kinds``: the same table the report's
advice reads), each finding's kind from its card, and a few conditions per link: the effect does not come
before its cause (steps), it is on the cause's ranks unless it spreads by communication (a reduced NaN, a
replica compared across ranks), and where the table asks, it is about the same module (a BatchNorm and its
buffers). Findings of one kind at one step are one event (bn_divergence on four modules at step 2; every
rank's NaN origin in a batch that all of them read). Linked findings are one incident; its root is a member
that nothing else in it can have caused, the one of the earliest kind in ``ORDER`` (a configuration before
statistics before replicas) among several, ties broken by step, then severity. Findings linked to nothing
stay incidents of their own: unrelated problems are never merged.

Pure: findings in, incidents out (no torch, no rich).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distdebug.cards import kind_of as kind
from distdebug.cards.kinds import CAUSES, LATER, NOT_CONSEQUENCES, ORDER, SPREADS, WINDOW
from distdebug.findings import Finding, Severity

__all__ = ["CAUSES", "ORDER", "SPREADS", "WINDOW", "Incident", "group", "kind", "linked", "same_event"]


@dataclass
class Incident:
    """One problem: its root finding, what followed from it (root first), the severity of the worst member,
    and the root's fix."""

    root: Finding
    members: list[Finding] = field(default_factory=list)
    _consequences: list[Finding] | None = field(default=None, repr=False, compare=False)

    @property
    def severity(self) -> Severity:
        return max((Severity(m.severity) for m in self.members), key=lambda s: s.order)

    @property
    def title(self) -> str:
        return f"{self.root.detector}: {self.root.subject}"

    def consequences(self) -> list[Finding]:
        """The members that follow from the root (or from its own event: the same detector at its step) by a
        chain of causal links, not those merged into it only as one event with a later member (a BatchNorm that
        differed before the NaN, on the module that differs after it, keeps its own cause); never the root's own
        detector's findings (its event) nor the kinds in ``NOT_CONSEQUENCES``. Computed once."""
        if self._consequences is None:
            kinds = {id(m): kind(m) for m in self.members}
            reached = [m for m in self.members if m is self.root or (m.detector == self.root.detector
                                                                      and same_event(self.root, m))]
            rest = [m for m in self.members if not any(m is r for r in reached)]
            grew = True
            while grew:
                grew = False
                for m in list(rest):
                    if any(_linked(r, m, kinds[id(r)], kinds[id(m)]) for r in reached):
                        reached.append(m)
                        rest.remove(m)
                        grew = True
            self._consequences = [m for m in reached if m.detector != self.root.detector
                                  and kinds[id(m)] not in NOT_CONSEQUENCES]
        return self._consequences

    def to_dict(self) -> dict[str, Any]:
        return {"severity": self.severity.value, "title": self.title, "root": self.root.to_dict(),
                "fix": self.root.fix, "members": [m.to_dict() for m in self.members]}


def _modules(f: Finding) -> list[str]:
    """The modules a cause is about: a config warning's BatchNorm modules, a bn_divergence's module."""
    if f.detector == "config_lint":
        return [str(m) for m in (f.evidence or {}).get("modules") or []]
    return [f.subject]


def _about(module: str, effect: Finding) -> bool:
    """Whether an effect (a BatchNorm's statistics, a replica's tensor) is about ``module`` or inside it."""
    s = effect.subject
    return s == module or s.startswith(module + ".") or not module


def linked(cause: Finding, effect: Finding) -> bool:
    """Whether ``effect`` can follow from ``cause`` by the table, its steps, ranks and modules."""
    return _linked(cause, effect, kind(cause), kind(effect))


def _linked(cause: Finding, effect: Finding, a: str, b: str) -> bool:
    """``linked`` with both kinds known (group() works them out once per finding, not once per pair)."""
    if b not in CAUSES.get(a, ()):
        return False
    if cause.step is not None and effect.step is not None and (
            effect.step < cause.step or effect.step - cause.step > WINDOW.get((a, b), effect.step - cause.step)
            or ((a, b) in LATER and effect.step == cause.step)):
        return False
    if (a, b) == ("crash", "hang") and (cause.step is None or effect.step is None):
        return False  # a hang verdict with no step (a stall, the start-up) is not a rank's death at its step
    if (a, b) not in SPREADS and cause.ranks and effect.ranks and not set(cause.ranks) & set(effect.ranks):
        return False
    if a in ("config", "statistics") and b in ("statistics", "replica"):
        return any(_about(m, effect) for m in _modules(cause))
    if (a, b) == ("replica", "verdict") or (a, b) == ("nan", "verdict"):
        return effect.step == cause.step or cause.step is None
    return True


def same_event(f: Finding, g: Finding) -> bool:
    """Two findings of one event: the same detector at the same step (several modules, tensors or ranks
    of one happening), a rank's loss spike and its departure from the other ranks at that step, or the
    same detector on the same subject again (a straggler slow at step 10 and still at step 40)."""
    return _same_event(f, g, kind(f))


def _same_event(f: Finding, g: Finding, kf: str) -> bool:
    if f.detector != g.detector:
        return False
    if f.subject == g.subject and f.detector != "loss_spike":
        return True
    if f.step is None or f.step != g.step:
        return False
    if kf == "other":  # unrelated notes of one detector at one step (two configuration notes) stay apart
        return False
    if f.detector == "loss_spike":
        return bool(set(f.ranks) & set(g.ranks)) or not f.ranks or not g.ranks
    return True


def group(findings: list[Finding]) -> list[Incident]:
    """The incidents of a run's findings, the most severe first, then by the root's step."""
    n = len(findings)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    kinds = [kind(f) for f in findings]  # once per finding: a card's variants are predicates
    for i in range(n):
        for j in range(i + 1, n):
            f, g = findings[i], findings[j]
            if _same_event(f, g, kinds[i]) or _linked(f, g, kinds[i], kinds[j]) or _linked(g, f, kinds[j], kinds[i]):
                parent[find(i)] = find(j)
    of = {id(f): k for f, k in zip(findings, kinds, strict=True)}
    groups: dict[int, list[Finding]] = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(findings[i])

    def depth(f: Finding) -> tuple[int, int, int]:
        return (ORDER.index(of[id(f)]), f.step if f.step is not None else -1, -Severity(f.severity).order)

    incidents = []
    for members in groups.values():
        # The root: a member nothing else in the incident can have caused (the table both ways, a replica's
        # divergence and BatchNorm statistics, is settled by the steps); among those the earliest kind.
        causes = [m for m in members if not any(o is not m and _linked(o, m, of[id(o)], of[id(m)])
                                                for o in members)] or members
        root = min(causes, key=depth)
        incidents.append(Incident(root=root, members=[root, *sorted((m for m in members if m is not root),
                                                                    key=depth)]))
    return sorted(incidents, key=lambda i: (-i.severity.order, i.root.step if i.root.step is not None else -1,
                                            i.root.detector, i.root.subject))

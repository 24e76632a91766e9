"""What a card is: one kind of finding, said once for every place that explains it.

Why one type: a finding's meaning used to live in four places (the detector's description, the report's
advice, the incidents' causal table, the README), and nothing checked they agreed or were filled in. A card
holds all of it, torch-free, so that the report, the incidents, ``distdebug detectors``, ``distdebug
explain`` and the docs read the same words.

A card's advice is a list of variants, each for one case of the finding (a NaN that started here or was
only received; a straggler slowed by its data or by its compute), the last one the general case. A
variant's texts are templates filled from the finding: ``{ranks}``, ``{step}``, ``{at}`` (`` --step N`` or
nothing), ``{subject}``, ``{run_dir}``, ``{ev[key]}`` (its evidence) and ``{root_when}`` (`` at step N`` of the
incident's root, or `` before the first step``, where a variant is about it). Evidence goes inside ``[[ ]]``: the
words between them are said only where the finding has every piece of evidence they name, and never in the
docs or ``explain``, which have none (a template's placeholder leaked into them before: "non-finite <checked>").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from distdebug.findings import Finding

LOSS_X10 = "loss suddenly x10 or NaN"
SLOW = "GPU utilisation stuck under 50 %, slow steps"
LOSSES_DIFFER = "ranks' losses or weights differ"
OOM_FORWARD = "out of memory in forward, not backward"
OOM = "out of memory"
RESTORE = "loss jumps after restoring a checkpoint"
HANG = "job stuck until the collective timeout"
ENVIRONMENT = "job fails to start, or runs slow, on some nodes only"
CONFIG = "a configuration trap (runs, but wrong or slow)"
REPRODUCE = "two runs of the same script do not match"
DISK = "a disk fills in the middle of a long job"
AFTER_END = "job failed after the last step"
HARNESS = "what distdebug could not do or see in this run"
NOTE = "a note for reading the run (no fault)"


@dataclass(frozen=True)
class Advice:
    """What the report says beside a finding: the symptom a user would have seen, the likely cause, what to
    look at next (a command where distdebug has one) and the fix."""

    symptom: str
    cause: str
    check: str
    fix: str
    consequence_of: str = ""
    """Where this finding probably follows from another (its incident's root): that root, as ``CODE detector at
    step N``; its ``fix`` is then the root's to fix first, and wins over the finding's own."""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Context:
    """What a variant may depend on besides its finding: the run directory its commands name, and the root of
    the incident the finding belongs to when that root is another kind's finding (analysis.causal)."""

    run_dir: str = "RUN"
    root: Finding | None = None


Predicate = Callable[[Finding, Context], bool]


def always(f: Finding, c: Context) -> bool:
    return True


@dataclass(frozen=True)
class Variant:
    """One case of a finding and its advice. ``case``: when it applies, in words (the docs and ``explain``
    print it; ``when`` is the same in code). ``own_fix``: the finding's own fix, where it has one, wins over
    ``fix`` (a detector that named the framework knob knows more than the card). ``explains_root``: the
    advice already says how the incident's root caused this (the report does not add "probably a
    consequence"). ``kind``: the causal kind in this case, where it differs from the card's."""

    case: str
    symptom: str
    cause: str
    check: str
    fix: str
    when: Predicate = always
    own_fix: bool = False
    explains_root: bool = False
    kind: str | None = None


class _Evidence(dict):  # type: ignore[type-arg]
    def __missing__(self, key: str) -> str:
        return "?"


class _Fields(dict):  # type: ignore[type-arg]
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def ranks_words(f: Finding, none: str = "the ranks") -> str:
    """``rank 1`` / ``ranks 0, 3``: at most eight, then ``...``."""
    if not f.ranks:
        return none
    return ("rank " if len(f.ranks) == 1 else "ranks ") + ", ".join(str(r) for r in f.ranks[:8]) + \
        ("..." if len(f.ranks) > 8 else "")


_OPTIONAL = re.compile(r"\[\[(.*?)\]\]", re.S)
_EV_KEY = re.compile(r"\{ev\[(\w+)\]\}")


def _segments(template: str, evidence: dict[str, Any] | None) -> str:
    """The template with each ``[[...]]`` kept (without its brackets) where ``evidence`` has a value for every key
    it names, dropped otherwise (always, for ``None``: the docs)."""
    if "[[" not in template:
        return template

    def keep(m: re.Match[str]) -> str:
        keys = _EV_KEY.findall(m.group(1))
        has = evidence is not None and all(evidence.get(k) not in (None, "", [], {}) for k in keys)
        return m.group(1) if has else ""

    return _OPTIONAL.sub(keep, template)


def fill(template: str, f: Finding, c: Context) -> str:
    """A variant's text with the finding's fields in it; a field the finding lacks reads ``?``."""
    if "{" not in template and "[[" not in template:
        return template
    template = _segments(template, {str(k): v for k, v in dict(f.evidence or {}).items()})
    try:
        root = c.root.step if c.root is not None else None
        fields = _Fields(ranks=ranks_words(f), a_rank=ranks_words(f, "a rank"),
                         step=f.step if f.step is not None else "?",
                         at=f" --step {f.step}" if f.step is not None else "",
                         subject=f.subject, run_dir=c.run_dir,
                         ev=_Evidence({str(k): v for k, v in dict(f.evidence or {}).items()}),
                         root_when=f" at step {root}" if root else " before the first step")
        return template.format_map(fields)
    except (IndexError, KeyError, ValueError, AttributeError, TypeError):
        return template


_GENERIC = {"ranks": "the rank(s)", "a_rank": "a rank", "step": "N", "at": " --step N", "subject": "SUBJECT",
            "run_dir": "RUN", "root_when": " at its step"}


def generic(template: str) -> str:
    """A variant's text as the docs print it, with placeholders for what a finding fills in (the words that need
    evidence left out)."""
    template = _segments(template, None)
    if "{" not in template:
        return template
    fields = _Fields(_GENERIC, ev=_Placeholder())
    try:
        return template.format_map(fields)
    except (IndexError, KeyError, ValueError, AttributeError, TypeError):
        return template


class _Placeholder(dict):  # type: ignore[type-arg]
    def __missing__(self, key: str) -> str:
        return f"<{key}>"


@dataclass(frozen=True)
class Option:
    """One option a card's finding source takes: its key (``--detector-option NAME.KEY=V``), default, and
    meaning; ``flag``: attach's own shorthand for it, where there is one."""

    key: str
    default: Any
    help: str
    flag: str = ""


@dataclass(frozen=True)
class Card:
    """One kind of finding: everything distdebug says about it, in one place.

    ``name`` is what a finding's ``detector`` field holds; ``code`` is stable (``DD`` and three digits: the
    hundreds are the family) and never reused. ``source``: what produces it (a detector on the ranks, the
    launcher's verdict after the job, doctor). ``kind``: its place in the causal model (analysis.causal)."""

    code: str
    name: str
    title: str
    """One line: what it finds (``distdebug detectors`` prints it)."""
    source: str
    severities: tuple[str, ...]
    meaning: str
    subjects: str
    causes: tuple[str, ...]
    check: str
    fix: str
    variants: tuple[Variant, ...]
    kind: str
    noun: str
    """How a consequence names it: "probably a consequence of {noun} from step N"."""
    faults: tuple[str, ...] = ()
    """Faults (``distdebug faults list``) that reproduce it."""
    options: tuple[Option, ...] = ()
    cost: str = "none on the training: it is computed from what the run already records"
    default: bool = True
    """For a detector: on unless named (``--detectors``)."""
    family: str = field(default="")

    def variant(self, f: Finding, c: Context) -> Variant:
        """The first variant whose case holds (the last one always does)."""
        for v in self.variants:
            try:
                if v.when(f, c):
                    return v
            except Exception:  # a predicate on evidence of another shape: not this case
                continue
        return self.variants[-1]

    def advise(self, f: Finding, c: Context | None = None, v: Variant | None = None) -> Advice:
        """The advice of the finding's case (``v``: that case, where the caller has already found it)."""
        c = c or Context()
        v = v or self.variant(f, c)
        fix = (f.fix or "") if v.own_fix and f.fix else fill(v.fix, f, c)
        return Advice(fill(v.symptom, f, c), fill(v.cause, f, c), fill(v.check, f, c), fix or (f.fix or ""))

    def kind_of(self, f: Finding) -> str:
        """The finding's causal kind: its case's where that says one (no root is known here), else the card's."""
        return self.variant(f, Context()).kind or self.kind

    @property
    def kinds(self) -> set[str]:
        """Every kind this card's findings can be: the card's and its cases' (config_lint's broadcast_buffers)."""
        return {self.kind, *(v.kind for v in self.variants if v.kind)}

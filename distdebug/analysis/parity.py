"""Does the candidate run compute what the reference computes? The comparison's arithmetic (issue 50).

Two layouts of one training (1 rank against N, DDP against FSDP2) never agree bit for bit: sums run in another
order. So each compared quantity (the global loss, the global gradient norm, each recorded tensor's sketch:
``fingerprint.sketch``) is judged against a band computed from the runs themselves, not a guessed tolerance:
a **twin** of the reference, the same run with the last bit of its parameters perturbed before its first step and
after every step, shows how
far benign rounding carries a run apart, and how that grows with the steps. For each quantity ``x``:

- ``d_twin(x, t)``: the reference against its twin at step ``t``; ``d_cand(x, t)``: against the candidate;
- the band ``B(x, t) = max(floor(x), max over s <= t of d_twin(x, s))``: what rounding has shown it can do by
  then (a running maximum: noise that once reached a size may again), never below an analytic floor (a few
  units in the last place of the quantity: a twin may happen to agree exactly at a step);
- the ratio ``r(x, t) = d_cand(x, t) / (K * B(x, t))``: the candidate departs at the first step where some
  ratio exceeds 1.

``K`` (``SLACK``) covers what the twin cannot: the candidate's own rounding is not the twin's perturbation,
only of its size. Its value is for the clean pairs to fix (issue 50's benchmark: the bound at most 20x the
benign difference, no false alarm); this module takes it as given.

The verdict localises: the first step, and at it the first tensor in the model's order whose ratio exceeds 1
(gradients are compared before parameters: a wrong gradient makes the parameters wrong one update later), and
the step at which the loss departs. Nothing here reads a run directory or torch: numbers in, a verdict out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

SLACK = 8.0
"""K: how far beyond the twin's band a candidate may be before it departs (to be fixed on the clean pairs)."""
ULPS = 4
"""The band's analytic floor, in units in the last place of the quantity's size (float32's by default)."""
EPS = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float64": 2.0 ** -52}

EPS_NAME = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16",
            "torch.float64": "float64"}
"""A parameter's recorded dtype -> its name in EPS."""

Series = Mapping[int, float]
"""step -> a distance between two runs (or a quantity's size, for the floor)."""


@dataclass
class Departure:
    quantity: str
    """``loss``, ``grad_norm``, or a tensor's name (``grad:layer.weight``, ``param:layer.weight``)."""
    step: int
    observed: float
    """The candidate's distance from the reference at that step."""
    bound: float
    """``SLACK`` times the band there."""

    @property
    def ratio(self) -> float:
        """observed / bound: 0 when both runs agree exactly, infinite for a distance that is not a number (a NaN or
        an Inf in the candidate: never within a band)."""
        if not math.isfinite(self.observed):
            return math.inf
        if self.observed == 0:
            return 0.0
        return self.observed / self.bound if self.bound > 0 else math.inf


@dataclass
class Verdict:
    equivalent: bool
    largest: Departure | None
    """The largest observed/bound over every quantity and step (equivalent or not)."""
    first: Departure | None = None
    """Where it departs first: the earliest step, then the first quantity in the model's order."""
    loss_departs: int | None = None
    """The first step the loss itself is out of its band (None: never)."""
    compared: int = 0
    """Quantity-steps compared."""
    missing: list[str] = field(default_factory=list)
    """Quantities one run has and the other lacks (not compared: said)."""

    def text(self) -> str:
        if self.largest is None:
            return "nothing to compare: no quantity recorded by both runs at the same step"
        big = self.largest
        if self.equivalent:
            return (f"equivalent (largest observed/bound {big.ratio:.2g} at step {big.step}, {big.quantity}; "
                    f"{self.compared} compared)")
        assert self.first is not None
        f = self.first
        loss = (f"; the loss departs at step {self.loss_departs}" if self.loss_departs is not None
                else "; the loss stays within its band")
        return (f"departs at step {f.step}: first {f.quantity} at observed/bound {f.ratio:.3g} "
                f"({f.observed:.3g} against {f.bound:.3g}){loss}")


def band(twin: Series, floor: Series, upto: Iterable[int]) -> dict[int, float]:
    """``B(t)`` for each step of ``upto``: the running maximum of the twin's distance at or before ``t``, never
    below ``floor[t]``. A step the twin lacks carries the last maximum on."""
    out: dict[int, float] = {}
    running = 0.0
    known = sorted(twin)
    i = 0
    for t in sorted(upto):
        while i < len(known) and known[i] <= t:
            running = max(running, twin[known[i]])
            i += 1
        out[t] = max(running, floor.get(t, 0.0))
    return out


def floor_of(size: Series, dtype: str = "float32", ulps: int = ULPS) -> dict[int, float]:
    """The analytic floor of a quantity whose size (a loss's magnitude, a tensor's norm) is ``size``: ``ulps``
    units in the last place of it in ``dtype``."""
    eps = EPS[dtype]
    return {t: ulps * eps * abs(v) for t, v in size.items()}


def compare(cand: Mapping[str, Series], twin: Mapping[str, Series], sizes: Mapping[str, Series],
            order: list[str], slack: float = SLACK, dtype: str = "float32",
            dtypes: Mapping[str, str] | None = None) -> Verdict:
    """The verdict over every quantity: ``cand[x][t]`` the candidate's distance from the reference, ``twin[x][t]``
    the twin's, ``sizes[x][t]`` the quantity's size in the reference (for the floor); ``order``: the quantities
    in the order a departure is named in at one step (gradients in the model's order, then parameters, then the
    global figures they feed); ``dtypes``: a quantity's own dtype for its floor (else ``dtype``)."""
    missing = sorted(set(cand) ^ set(twin))
    rank = {q: i for i, q in enumerate(order)}
    departures: list[Departure] = []
    largest: Departure | None = None
    compared = 0
    for q in sorted(set(cand) & set(twin), key=lambda q: (rank.get(q, len(rank)), q)):
        last = max(twin[q], default=0)  # past the twin's last step its band says nothing of how rounding grows
        steps = sorted(t for t in cand[q] if t <= last)
        b = band(twin[q], floor_of(sizes.get(q, {}), (dtypes or {}).get(q, dtype)), steps)
        for t in steps:
            bound = slack * b[t]
            d = Departure(q, t, cand[q][t], bound)
            compared += 1
            if largest is None or d.ratio > largest.ratio:
                largest = d
            if not d.ratio <= 1:
                departures.append(d)
    first = min(departures, key=lambda d: (d.step, rank.get(d.quantity, len(rank)), d.quantity), default=None)
    loss = min((d.step for d in departures if d.quantity == "loss"), default=None)
    return Verdict(equivalent=first is None and compared > 0, largest=largest, first=first, loss_departs=loss,
                   compared=compared, missing=missing)


def gradient_scale(ref_norms: Mapping[str, float], cand_norms: Mapping[str, float],
                   tolerance: float = 0.05) -> float | None:
    """The factor every gradient of the candidate is of the reference's, when they all agree on one far from 1
    (gradients summed instead of averaged over N ranks: N; a loss divided by the world size twice: 1/N); None
    when the tensors disagree on a factor or it is 1 (within ``tolerance``)."""
    ratios = [cand_norms[n] / ref_norms[n] for n in ref_norms
              if n in cand_norms and ref_norms[n] > 0 and cand_norms[n] > 0 and math.isfinite(cand_norms[n])]
    if len(ratios) < 2:
        return None
    mid = sorted(ratios)[len(ratios) // 2]
    if abs(mid - 1) <= tolerance or any(abs(r / mid - 1) > tolerance for r in ratios):
        return None
    return mid


# ---------------------------------------------------------------------------------------------- two run directories
@dataclass
class Recorded:
    """What one run's ``parity`` records hold (attach --parity), by step."""

    world: int
    twin: bool
    seed: int | None
    names: list[str]
    dtypes: dict[str, str]
    """Parameter name -> its dtype (``float32``...): the floor of its band is in its own units in the last place."""
    loss: dict[int, float]
    """The loss: the mean of the ranks' at each recorded step."""
    global_grad_norm: dict[int, float]
    sketches: dict[int, dict[str, list[float]]]
    """step -> ``grad:NAME`` / ``param:NAME`` -> the whole tensor's sketch: rank 0's of a replicated tensor
    (gradients are reduced: every data-parallel rank holds the same), the sum of its parts' of a sharded one."""
    norms: dict[int, dict[str, float]]


class CannotCompare(Exception):
    """Two runs that cannot be compared, with why (``distdebug parity`` exits 2)."""


def _last_attempt(records: list[dict]) -> list[dict]:
    from distdebug.artifacts import schema

    starts = [i for i, r in enumerate(records) if r.get("kind") == schema.START]
    return records[starts[-1]:] if starts else records


def recorded(run: Any) -> Recorded:
    """The parity records of a run (``artifacts.reader.load_run``'s), or why there are none. Each rank's stream is
    read whole (a parity run is a short one: the per-step records a reader at scale skips are wanted here)."""
    from distdebug.artifacts import layout, schema
    from distdebug.artifacts.reader import read_stream

    streams = {r: _last_attempt(read_stream(layout.events_path(run.dir_of(r), r))[0]) for r in run.ranks}
    attempt = {r: int((recs[0].get("attempt") or 0) if recs and recs[0].get("kind") == schema.START else 0)
               for r, recs in streams.items()}
    newest = max(attempt.values(), default=0)  # ranks of an earlier attempt (an elastic scale-down) are gone
    streams = {r: recs for r, recs in streams.items() if attempt[r] == newest}
    for r, recs in streams.items():
        failed = [x for x in recs if x.get("kind") == schema.FINDING and x.get("subject") == "detector:parity"]
        if failed:
            raise CannotCompare(f"{run.path}: the parity recorder failed on rank {r} ({failed[0].get('message')}): "
                                "its records are incomplete")
    per_rank = {r: [x for x in recs if x.get("kind") == schema.PARITY] for r, recs in streams.items()}
    per_rank = {r: recs for r, recs in per_rank.items() if recs}
    if not per_rank:
        raise CannotCompare(f"{run.path} has no parity records: run it with distdebug attach --parity")
    parts = [x for recs in per_rank.values() for x in recs if "param" in x]  # each rank's parts of the tensors
    if not parts:
        raise CannotCompare(f"{run.path}: its parity records hold no tensors (ZeRO-3 partitions are not recorded)")
    first = parts
    losses: dict[int, list[float]] = {}  # every step, every rank: the global loss is their mean
    for recs in streams.values():
        for x in recs:
            if x.get("kind") == schema.STEP and isinstance(x.get("loss"), (int, float)) and \
                    isinstance(x.get("step"), int) and x.get("harness") != "off":
                losses.setdefault(x["step"], []).append(float(x["loss"]))
    squares: dict[int, list[float]] = {}  # every step: the ranks' parts of the gradients' squared global norm
    for recs in streams.values():
        for x in recs:
            if x.get("kind") == schema.PARITY_STEP and isinstance(x.get("grad_sq_sum"), (int, float)):
                squares.setdefault(int(x["step"]), []).append(float(x["grad_sq_sum"]))
    holders = sum(1 for recs in streams.values() if any(x.get("kind") == schema.PARITY_STEP for x in recs))
    # a step only where every rank's part is there (a rank whose older steps the run-directory budget thinned
    # would otherwise make a mean of some ranks, a norm of some parts)
    losses = {t: v for t, v in losses.items() if len(v) == len(streams)}
    squares = {t: v for t, v in squares.items() if len(v) == holders}
    sketches: dict[int, dict[str, list[float]]] = {}
    squared: dict[int, dict[str, float]] = {}
    names: list[str] = []
    dtypes: dict[str, str] = {}
    for x in sorted(parts, key=lambda x: int(x.get("rank", 0))):  # a sharded tensor's parts, summed: the whole's
        step = int(x["step"])
        for kind, sq in (("grad", "grad_sq"), ("param", "param_sq")):
            if kind not in x:  # no gradient at the boundary (DeepSpeed ZeRO's own buffers): parameters only
                continue
            for n, v, q in zip(x["names"], x[kind], x[sq], strict=True):
                key = f"{kind}:{n}"
                have = sketches.setdefault(step, {}).get(key)
                sketches[step][key] = list(v) if have is None else [a + b for a, b in zip(have, v, strict=True)]
                squared.setdefault(step, {})[key] = squared.get(step, {}).get(key, 0.0) + float(q)
        names += [n for n in x["names"] if n not in names]
        dtypes.update(zip(x["names"], x.get("dtypes") or ["float32"] * len(x["names"]), strict=True))
    norms = {t: {k: math.sqrt(v) for k, v in q.items()} for t, q in squared.items()}
    world = len(streams)
    return Recorded(world=world, twin=bool(first[0].get("twin")), seed=first[0].get("seed"), names=names, dtypes=dtypes,
                    loss={t: sum(v) / len(v) for t, v in losses.items()},
                    global_grad_norm={t: math.sqrt(sum(v)) for t, v in squares.items()}, sketches=sketches,
                    norms=norms)


def distances(a: Recorded, b: Recorded, steps: list[int]) -> dict[str, dict[int, float]]:
    """Each quantity's distance between two runs: the loss and the gradient norm at every step both have, the
    tensors at each of ``steps`` (those both recorded)."""
    out: dict[str, dict[int, float]] = {
        "loss": {t: abs(a.loss[t] - b.loss[t]) for t in sorted(set(a.loss) & set(b.loss))},
        "grad_norm": {t: abs(a.global_grad_norm[t] - b.global_grad_norm[t])
                      for t in sorted(set(a.global_grad_norm) & set(b.global_grad_norm))}}
    for t in steps:
        for q, sa in a.sketches.get(t, {}).items():
            sb = b.sketches.get(t, {}).get(q)
            if sb is not None and len(sa) == len(sb):
                out.setdefault(q, {})[t] = math.sqrt(sum((x - y) ** 2 for x, y in zip(sa, sb, strict=True)))
    return {q: d for q, d in out.items() if d}


@dataclass
class Size:
    """One run's size and speed, for the side by side of two sizes (stage 2 of a scale-out)."""

    world: int
    median_step_ms: float | None
    """The slowest rank's median step (the job runs at its pace)."""
    peak_mb: float | None
    """The largest per-rank peak of parameters, gradients, optimizer state and activations (the memory detector's
    total at its largest step), in MB."""


def size_of(run: Any) -> Size:
    """A run's size and speed from its summary (analysis.summary)."""
    from distdebug.analysis.summary import summarize

    ranks = summarize(run).ranks
    times = [r.median_step_time_s for r in ranks if r.median_step_time_s]
    peaks = [r.memory_peak["total"] for r in ranks
             if r.memory_peak and isinstance(r.memory_peak.get("total"), (int, float))]
    return Size(world=len(ranks), median_step_ms=max(times) * 1000 if times else None,
                peak_mb=max(peaks) / 1e6 if peaks else None)


def side_by_side(ref: Size, cand: Size) -> str | None:
    """Step time and peak memory per size, and the scaling efficiency: the reference's step over N times the
    candidate's (1.0: N ranks take 1/N of the time the global batch takes on the reference's ranks). None when
    the runs are of one size or lack the figures."""
    if ref.world == cand.world or not ref.median_step_ms or not cand.median_step_ms:
        return None
    n = cand.world / ref.world
    eff = ref.median_step_ms / (n * cand.median_step_ms)

    def mem(s: Size) -> str:
        return f", peak {s.peak_mb:.3g} MB a rank" if s.peak_mb is not None else ""

    return (f"step time: {ref.world} rank(s) {ref.median_step_ms:.3g} ms{mem(ref)}; {cand.world} rank(s) "
            f"{cand.median_step_ms:.3g} ms{mem(cand)}; scaling efficiency {eff:.0%} (the same global batch on "
            f"{n:.3g}x the ranks)")


@dataclass
class Parity:
    verdict: Verdict
    steps: list[int]
    ref_world: int
    cand_world: int
    cause: str | None = None
    sizes: str | None = None
    """Stage 2: step time and peak memory per size, the scaling efficiency (``side_by_side``)."""
    upto: int | None = None
    """The twin's last step, when it ran fewer steps than the reference: nothing is compared past it."""

    def text(self) -> str:
        head = (f"parity of {self.cand_world} rank(s) against {self.ref_world}: the loss and gradient norm at every "
                f"step, the tensors at {len(self.steps)} recorded steps ({_steps(self.steps)}): {self.verdict.text()}")
        return head + (f"\nlikely cause: {self.cause}" if self.cause else "") + (
            f"\nnot compared (in one run only): {', '.join(self.verdict.missing[:8])}"
            + (" ..." if len(self.verdict.missing) > 8 else "") if self.verdict.missing else "") + (
            f"\n{self.sizes}" if self.sizes else "") + (
            f"\ncompared up to step {self.upto}, the twin's last: run the twin as long to compare the rest"
            if self.upto is not None else "")


def _steps(steps: list[int]) -> str:
    """``1-8, 16, 32``: runs of consecutive steps folded."""
    parts: list[str] = []
    for t in steps:
        if parts and "-" not in parts[-1].rsplit(", ", 1)[-1] and int(parts[-1]) == t - 1:
            parts[-1] = f"{parts[-1]}-{t}"
        elif parts and "-" in parts[-1] and int(parts[-1].split("-")[1]) == t - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{t}"
        else:
            parts.append(str(t))
    return ", ".join(parts)


def compare_runs(ref: Recorded, twin: Recorded, cand: Recorded, slack: float = SLACK) -> Parity:
    """The candidate against the reference, judged by the reference's twin (``attach --parity twin``)."""
    if ref.twin or not twin.twin:
        raise CannotCompare("the twin must be the run made with --parity twin, the reference with --parity record")
    if cand.twin:
        raise CannotCompare("the candidate was made with --parity twin: its results differ on purpose")
    if len({ref.seed, twin.seed, cand.seed}) != 1:
        raise CannotCompare(f"the runs' sketch seeds differ ({ref.seed}, {twin.seed}, {cand.seed})")
    for name, run in (("reference", ref), ("twin", twin)):
        bad = sorted(t for t, v in run.loss.items() if not math.isfinite(v))
        if bad:
            raise CannotCompare(f"the {name}'s loss is not finite from step {bad[0]}: it cannot be the measure")
    ref_last, cand_last = max(ref.loss, default=0), max(cand.loss, default=0)
    if cand_last < ref_last:
        raise CannotCompare(f"the candidate's steps end at {cand_last}, the reference's at {ref_last}: compare runs "
                            "of the same length (a run that ended early is seen in its own report)")
    steps = sorted(set(ref.sketches) & set(twin.sketches) & set(cand.sketches))
    if not steps:
        raise CannotCompare("no step was recorded by all three runs")
    if not set(ref.names) & set(cand.names):
        raise CannotCompare("the reference and the candidate share no parameter name: not the same model")
    d_cand, d_twin = distances(ref, cand, steps), distances(ref, twin, steps)
    sizes: dict[str, dict[int, float]] = {"loss": {t: abs(v) for t, v in ref.loss.items()},
                                          "grad_norm": dict(ref.global_grad_norm)}
    for t in steps:
        for q, v in ref.norms.get(t, {}).items():
            sizes.setdefault(q, {})[t] = v
    # at one step, the tensor is named before the global figures it feeds (the loss is told apart: loss_departs)
    order = [*[f"grad:{n}" for n in ref.names], *[f"param:{n}" for n in ref.names], "grad_norm", "loss"]
    kinds = {f"{k}:{n}": EPS_NAME.get(d, "float32") for n, d in ref.dtypes.items() for k in ("grad", "param")}
    verdict = compare(d_cand, d_twin, sizes, order, slack, dtypes=kinds)
    if verdict.compared == 0:
        raise CannotCompare("nothing was compared: no quantity recorded by the reference, its twin and the candidate "
                            "at the same steps")
    upto = max(twin.loss, default=0)
    cause = None
    if verdict.first is not None:
        t = verdict.first.step
        grads = {q: v for q, v in ref.norms.get(t, {}).items() if q.startswith("grad:")}
        factor = gradient_scale(grads, {q: v for q, v in cand.norms.get(t, {}).items() if q.startswith("grad:")})
        n = cand.world / ref.world if ref.world else 0
        if factor is not None and n > 1 and abs(factor / n - 1) < 0.05:
            cause = (f"every gradient is {factor:.3g}x the reference's ({cand.world} ranks against {ref.world}): "
                     "summed over the ranks instead of averaged (a loss not divided by the world size, or "
                     "all_reduce SUM without the division)")
        elif factor is not None and n > 1 and abs(factor * n - 1) < 0.05:
            cause = (f"every gradient is 1/{1 / factor:.3g} of the reference's: divided by the world size twice (an "
                     "average of averages, or a loss divided by the world size before DDP averages)")
        elif factor is not None:
            cause = f"every gradient is {factor:.3g}x the reference's: a loss or learning rate scaled differently"
    return Parity(verdict, steps, ref.world, cand.world, cause,
                  upto=upto if upto < max(ref.loss, default=0) else None)

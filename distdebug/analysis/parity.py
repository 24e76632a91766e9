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
    departed: dict[str, int] = field(default_factory=dict)
    """Each quantity that leaves its band -> the first step it does (what the cause catalogue reads)."""

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
    departed: dict[str, int] = {}
    for d in departures:
        departed[d.quantity] = min(d.step, departed.get(d.quantity, d.step))
    return Verdict(equivalent=first is None and compared > 0, largest=largest, first=first, loss_departs=loss,
                   compared=compared, missing=missing, departed=departed)


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
    buffers: list[str] = field(default_factory=list)
    """The floating buffers' names (``buffer:NAME`` in ``sketches``)."""
    buffer_dtypes: dict[str, str] = field(default_factory=dict)
    hyper: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """step -> each optimizer parameter group's numbers (lr, momentum, weight_decay, betas...)."""
    state_dtypes: dict[int, dict[str, dict[str, str]]] = field(default_factory=dict)
    """step -> parameter name -> the optimizer state's floating tensors' dtypes (``exp_avg``: ``bfloat16``)."""
    rank_grads: dict[int, dict[int, dict[str, float]]] = field(default_factory=dict)
    """step -> rank -> each replicated gradient's norm on that rank (every rank's, not only rank 0's)."""
    data: dict[int, list[float]] = field(default_factory=dict)
    """step -> the data's fingerprint summed over the ranks (only steps where every rank took one)."""
    rows: dict[int, int] = field(default_factory=dict)
    """step -> the samples the ranks' training forwards saw together."""
    widths: dict[int, list[int]] = field(default_factory=dict)
    """step -> the widths (numbers per sample read, at most the recorder's WIDTH) of those forwards' inputs: two
    runs' data are compared only where they agree (a batch split along another dimension than the first, or each
    rank padding to its own length, changes them)."""
    dp_world: int = 0
    """The data-parallel size (rank 0's data-parallel group; 0: not recorded, the world size is used)."""
    autocast: str | None = None
    """The dtype the training forwards compute in under autocast (``bfloat16``); None: the parameters' own."""
    clips: dict[int, dict[int, list[float]]] = field(default_factory=dict)
    """step -> data-parallel rank -> the norms its clipping calls clipped by that step (``clip_grad_norm_``,
    ``clip_grads_with_norm_``), in call order."""
    stages: int = 1
    """The most pipeline stages one rank ran and recorded (an interleaved schedule: several)."""


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
    several = sorted(int(r) for r, recs in per_rank.items()
                     if any((x.get("stages_held") or 1) > (x.get("stages_recorded") or 1) for x in recs))
    if several:
        raise CannotCompare(f"{run.path}: rank {several[0]} runs several pipeline stages (an interleaved schedule) "
                            "and the recorder could not read them all (stages whose parameters are not each a part "
                            "of the whole model under its own names): part of the model would go uncompared; build "
                            "the stages from the whole model keeping its names (torchtitan's split), or compare a "
                            "schedule of one stage a rank (ScheduleGPipe, Schedule1F1B)")
    parts = [x for recs in per_rank.values() for x in recs if "param" in x]  # each rank's parts of the tensors
    if not parts:
        raise CannotCompare(f"{run.path}: its parity records hold no tensors (no model was found to record)")
    first = parts
    losses: dict[int, list[float]] = {}  # every step, every rank: the global loss is their mean
    for recs in streams.values():
        for x in recs:
            if x.get("kind") == schema.STEP and isinstance(x.get("loss"), (int, float)) and \
                    isinstance(x.get("step"), int) and x.get("harness") != "off":
                losses.setdefault(x["step"], []).append(float(x["loss"]))
    # the loss as backward ran on it, summed over the step's backward calls (what the parity recorder reads every
    # step): under accumulation it is the loss whose gradient the step applies, where the step record's loss is
    # the micro-batches' mean; runs recorded without it compare the step records' loss
    totals: dict[int, list[float]] = {}
    squares: dict[int, list[float]] = {}  # every step: the ranks' parts of the gradients' squared global norm
    holders = 0  # the ranks that hold gradients (their parts make the global norm)
    clips: dict[int, dict[int, list[float]]] = {}
    for r, recs in streams.items():
        held = False
        for x in recs:
            if x.get("kind") != schema.PARITY_STEP:
                continue
            if isinstance(x.get("clip"), list):
                clips.setdefault(int(x["step"]), {})[int(r)] = [float(v) for v in x["clip"]]
            if isinstance(x.get("loss_total"), (int, float)):
                totals.setdefault(int(x["step"]), []).append(float(x["loss_total"]))
            if "grad_sq_sum" in x:
                held = True
                if isinstance(x["grad_sq_sum"], (int, float)):
                    squares.setdefault(int(x["step"]), []).append(float(x["grad_sq_sum"]))
        holders += held
    # a step only where every rank's sum, or every rank that holds a loss in its step records (a pipeline's last
    # stage: the others never compute one), or every part of the norm is there (a rank whose older steps the
    # run-directory budget thinned would otherwise make a mean of some ranks, a norm of some parts)
    totals = {t: v for t, v in totals.items() if len(v) == len(streams)}  # every rank's (a pipeline records none)
    if totals:
        losses = totals
    holding = _holders(losses, streams)
    losses = {t: v for t, v in losses.items() if len(v) == holding}
    squares = {t: v for t, v in squares.items() if len(v) == holders}
    sketches: dict[int, dict[str, list[float]]] = {}
    squared: dict[int, dict[str, float]] = {}
    names: list[str] = []
    dtypes: dict[str, str] = {}
    buffers: list[str] = []
    buffer_dtypes: dict[str, str] = {}
    hyper: dict[int, list[dict[str, Any]]] = {}
    state_dtypes: dict[int, dict[str, dict[str, str]]] = {}
    for x in sorted(parts, key=lambda x: int(x.get("rank", 0))):  # a sharded tensor's parts, summed: the whole's
        step = int(x["step"])
        if isinstance(x.get("hyper"), list) and step not in hyper:
            hyper[step] = x["hyper"]
        if isinstance(x.get("state_dtypes"), dict):
            state_dtypes.setdefault(step, {}).update(x["state_dtypes"])
        for kind, sq, key_names in (("grad", "grad_sq", "names"), ("buffer", "buffer_sq", "buffer_names"),
                                    ("param", "param_sq", "names")):
            if kind not in x:  # no gradient at the boundary (DeepSpeed ZeRO's own buffers): parameters only
                continue
            for n, v, q in zip(x[key_names], x[kind], x[sq], strict=True):
                key = f"{kind}:{n}"
                have = sketches.setdefault(step, {}).get(key)
                sketches[step][key] = list(v) if have is None else [a + b for a, b in zip(have, v, strict=True)]
                squared.setdefault(step, {})[key] = squared.get(step, {}).get(key, 0.0) + float(q)
        names += [n for n in x["names"] if n not in names]
        dtypes.update(zip(x["names"], x.get("dtypes") or ["float32"] * len(x["names"]), strict=True))
        buffers += [n for n in x.get("buffer_names") or () if n not in buffers]
        buffer_dtypes.update(zip(x.get("buffer_names") or (), x.get("buffer_dtypes") or (), strict=False))
    norms = {t: {k: math.sqrt(v) for k, v in q.items()} for t, q in squared.items()}
    # the ranks whose batches together are the global batch, and whose replicated gradients must agree: rank 0's
    # data-parallel group (its tensor- or pipeline-parallel peers read the same batch, or none), first stage only
    where = {int(r): x for r, recs in per_rank.items() for x in recs[:1]}
    group = where.get(0, {}).get("dp") if 0 in where else None
    dp = sorted(int(r) for r in (group if isinstance(group, list) else streams))
    feeders = [r for r in dp if where.get(r, {}).get("first_stage", True)]
    rank_grads: dict[int, dict[int, dict[str, float]]] = {}
    data: dict[int, list[list[float]]] = {}
    rows: dict[int, int] = {}
    widths: dict[int, set[int]] = {}
    for r, recs in per_rank.items():
        for x in recs:
            step = int(x["step"])
            if isinstance(x.get("rank_grad_sq"), list) and int(r) in dp:
                rank_grads.setdefault(step, {})[int(r)] = {
                    n: math.sqrt(max(float(q), 0.0)) for n, q in zip(x.get("rank_names") or (), x["rank_grad_sq"],
                                                                     strict=False)}
            if isinstance(x.get("data"), list) and int(r) in feeders:
                data.setdefault(step, []).append([float(v) for v in x["data"]])
                rows[step] = rows.get(step, 0) + int(x.get("rows") or 0)
                widths.setdefault(step, set()).update(int(w) for w in x.get("widths") or ())
    # the data's fingerprint where every feeding rank took one (a rank without one: that step's data is not compared)
    summed = {t: [sum(col) for col in zip(*v, strict=True)] for t, v in data.items()
              if len(v) == len(feeders) and len({len(x) for x in v}) == 1}
    world = len(streams)
    return Recorded(world=world, twin=bool(first[0].get("twin")), seed=first[0].get("seed"), names=names, dtypes=dtypes,
                    loss={t: sum(v) / len(v) for t, v in losses.items()},
                    global_grad_norm={t: math.sqrt(sum(v)) for t, v in squares.items()}, sketches=sketches,
                    norms=norms, buffers=buffers, buffer_dtypes=buffer_dtypes, hyper=hyper,
                    state_dtypes=state_dtypes, rank_grads=rank_grads, data=summed,
                    rows={t: rows[t] for t in summed}, widths={t: sorted(widths.get(t, ())) for t in summed},
                    dp_world=len(dp), autocast=next((x["autocast"] for x in parts if x.get("autocast")), None),
                    clips={t: {r: v for r, v in per.items() if r in dp} for t, per in clips.items()},
                    stages=max((int(x.get("stages_recorded") or 1) for x in parts), default=1))


def distances(a: Recorded, b: Recorded, steps: list[int]) -> dict[str, dict[int, float]]:
    """Each quantity's distance between two runs: the loss and the gradient norm at every step both have, the
    tensors at each of ``steps`` (those both recorded and finite in ``a``, the reference)."""
    out: dict[str, dict[int, float]] = {
        "loss": {t: abs(a.loss[t] - b.loss[t]) for t in sorted(set(a.loss) & set(b.loss))},
        "grad_norm": {t: abs(a.global_grad_norm[t] - b.global_grad_norm[t])
                      for t in sorted(set(a.global_grad_norm) & set(b.global_grad_norm))}}
    for t in steps:
        for q, sa in a.sketches.get(t, {}).items():
            sb = b.sketches.get(t, {}).get(q)
            # a tensor not finite in the reference itself (a mask of -inf, a buffer never written) has no distance:
            # not compared, rather than a departure of every candidate
            if sb is not None and len(sa) == len(sb) and all(map(math.isfinite, sa)):
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
    comm_share: float | None = None
    """The share of the step spent in collectives (the first profiler window's, median over the ranks: attach
    --profile-steps); None: not profiled."""


def size_of(run: Any) -> Size:
    """A run's size and speed from its summary (analysis.summary)."""
    from distdebug.analysis.summary import summarize

    summary = summarize(run)
    ranks = summary.ranks
    times = [r.median_step_time_s for r in ranks if r.median_step_time_s]
    peaks = [r.memory_peak["total"] for r in ranks
             if r.memory_peak and isinstance(r.memory_peak.get("total"), (int, float))]
    share = next((w["summary"].get("comm_share") for w in summary.windows
                  if isinstance(w.get("summary", {}).get("comm_share"), (int, float))), None)
    return Size(world=len(ranks), median_step_ms=max(times) * 1000 if times else None,
                peak_mb=max(peaks) / 1e6 if peaks else None, comm_share=share)


def side_by_side(ref: Size, cand: Size) -> str | None:
    """Step time, peak memory and the communication share per size, and the scaling efficiency: the reference's
    step over N times the candidate's (1.0: N ranks take 1/N of the time the global batch takes on the reference's
    ranks). None when the runs are of one size or lack the figures."""
    if ref.world == cand.world or not ref.median_step_ms or not cand.median_step_ms:
        return None
    n = cand.world / ref.world
    eff = ref.median_step_ms / (n * cand.median_step_ms)

    def mem(s: Size) -> str:
        comm = f", communication {s.comm_share:.0%} of the step" if s.comm_share is not None else ""
        return (f", peak {s.peak_mb:.3g} MB a rank" if s.peak_mb is not None else "") + comm

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
    causes: list[Cause] = field(default_factory=list)
    """Every cause the catalogue finds evidence of, the most direct first (``cause`` is the first's text)."""
    series: dict[str, dict[int, float]] = field(default_factory=dict)
    """What the HTML view draws, by step: ``ref`` and ``cand`` (the two runs' losses), ``distance`` (the loss's
    distance between them) and ``bound`` (SLACK times its band)."""

    def text(self) -> str:
        head = (f"parity of {self.cand_world} rank(s) against {self.ref_world}: the loss and gradient norm at every "
                f"step, the tensors at {len(self.steps)} recorded steps ({_steps(self.steps)}): {self.verdict.text()}")
        also = "".join(f"\nalso: {c.text}" for c in self.causes[1:3])
        return head + (f"\nlikely cause: {self.cause}{also}" if self.cause else "") + (
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
    if twin.stages > 1:
        raise CannotCompare("the twin runs several pipeline stages a rank (an interleaved schedule): its noise before "
                            "the first step reaches the first stage it runs only; make the reference and its twin "
                            "with one stage a rank (ScheduleGPipe, Schedule1F1B), the candidate as it is")
    if twin.autocast != ref.autocast:
        raise CannotCompare(f"the twin computes in {twin.autocast or 'its parameters dtype'} and the reference in "
                            f"{ref.autocast or 'its parameters dtype'}: make the twin with the reference's autocast")
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
    # a gradient is a sum of the samples' contributions, which may cancel (a bias's gradient over a balanced batch
    # is small at one step): its rounding is relative to the terms' scale, not to the sum's. The largest (finite)
    # norm that gradient has so far stands for that scale, and at the start of training, where there is no "so
    # far", the largest over the first FLOOR_AHEAD recorded steps
    for q, by_step in sizes.items():
        if q.startswith("grad:") and by_step:
            sizes[q] = _scale_of_terms(by_step)
    sizes.update(_module_scale({q: v for q, v in sizes.items() if q.startswith("grad:")}))
    # at one step, the tensor is named before the global figures it feeds (the loss is told apart: loss_departs)
    # (a buffer, computed in the forward, before the parameters it does not feed)
    order = [*[f"grad:{n}" for n in ref.names], *[f"buffer:{n}" for n in ref.buffers],
             *[f"param:{n}" for n in ref.names], "grad_norm", "loss"]
    kinds = {f"{k}:{n}": EPS_NAME.get(d, "float32") for n, d in ref.dtypes.items() for k in ("grad", "param")}
    kinds.update({f"buffer:{n}": EPS_NAME.get(d, "float32") for n, d in ref.buffer_dtypes.items()})
    verdict = compare(d_cand, d_twin, sizes, order, slack, dtypes=kinds)
    loss_steps = sorted(t for t in d_cand.get("loss", {}) if t <= max(d_twin.get("loss", {}), default=0))
    loss_band = band(d_twin.get("loss", {}), floor_of(sizes["loss"]), loss_steps)
    series = {"ref": dict(ref.loss), "cand": dict(cand.loss),
              "distance": {t: d_cand["loss"][t] for t in loss_steps},
              "bound": {t: slack * b for t, b in loss_band.items()}}
    if verdict.compared == 0:
        raise CannotCompare("nothing was compared: no quantity recorded by the reference, its twin and the candidate "
                            "at the same steps")
    upto = max(twin.loss, default=0)
    found = causes(ref, cand, verdict, steps) if verdict.first is not None else []
    cause = found[0].text if found else None
    return Parity(verdict, steps, ref.world, cand.world, cause,
                  upto=upto if upto < max(ref.loss, default=0) else None, causes=found, series=series)


# ------------------------------------------------------------------------------------------------ the cause catalogue
@dataclass
class Cause:
    """One class of the real causes of a departure, with the evidence the runs hold for it."""

    kind: str
    """``hyperparameter``, ``dtype``, ``data``, ``unreduced``, ``gradient_scale``, ``batchnorm``, ``forward``,
    ``clipping``, ``update``: one of CAUSES."""
    step: int
    """The step the evidence is from."""
    text: str


CAUSES = {
    "hyperparameter": "an optimizer hyperparameter differs (a learning rate or weight decay scaled by the world size)",
    "dtype": "a parameter, buffer or optimizer state kept in another dtype (AdamW's moments in bfloat16)",
    "data": "the ranks together saw other samples (a data split that repeats or drops samples)",
    "unreduced": "a gradient differs between the ranks (never averaged over them)",
    "clipping": "gradients clipped by each rank's own norm (before the reduction, or a shard's) instead of the global",
    "gradient_scale": "every gradient scaled by one factor (summed over the ranks, or normalised by a local count)",
    "batchnorm": "BatchNorm statistics per rank instead of the whole batch's",
    "forward": "the forward computes otherwise with the same parameters and data (randomness drawn per rank)",
    "update": "the same gradients give other parameters (the optimizer's update differs)",
}
"""The catalogue, most direct evidence first: what ``causes`` can name (issue 50's classes)."""


def _ratio_words(c: float, r: float, n: float) -> str:
    if r == 0 or not math.isfinite(c / r):
        return ""
    x = c / r
    world = " (the world-size ratio)" if n > 1 and (abs(x / n - 1) < 1e-6 or abs(x * n - 1) < 1e-6) else ""
    return f", x{x:.4g}{world}"


def causes(ref: Recorded, cand: Recorded, verdict: Verdict, steps: list[int]) -> list[Cause]:
    """The likely causes of a departure, from what the two runs recorded at or before its first step: settings
    that differ (an optimizer's numbers, a dtype) and the data first (they explain what follows), then what the
    gradients show (a gradient the ranks disagree on, one factor on every gradient), then what departs first
    (BatchNorm's statistics; the loss with the same parameters and data; the parameters with the same
    gradients)."""
    first = verdict.first
    if first is None:
        return []
    s = first.step
    n = (cand.dp_world or cand.world) / (ref.dp_world or ref.world) if ref.world else 0.0
    out: list[Cause] = []
    # an optimizer's numbers
    for t in sorted(set(ref.hyper) & set(cand.hyper)):
        if t > s:
            break
        a, b = ref.hyper[t], cand.hyper[t]
        diffs = [f"{k} {gb[k]} in the candidate, {ga[k]} in the reference{_ratio_words(gb[k], ga[k], n)}"
                 for ga, gb in zip(a, b, strict=False) for k in sorted(set(ga) & set(gb))
                 if isinstance(ga[k], (int, float)) and isinstance(gb[k], (int, float))
                 and not math.isclose(ga[k], gb[k], rel_tol=1e-9, abs_tol=0.0)]
        if diffs:
            out.append(Cause("hyperparameter", t, f"the optimizer's {diffs[0]} at step {t}" + (
                f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else "")))
            break
    # a dtype: the parameters', the buffers', the optimizer state's
    for what, da, db in (("parameter", ref.dtypes, cand.dtypes), ("buffer", ref.buffer_dtypes, cand.buffer_dtypes)):
        other = [nm for nm in da if nm in db and _dt(da[nm]) != _dt(db[nm])]
        if other:
            nm = other[0]
            out.append(Cause("dtype", min(steps, default=s), f"the candidate keeps {what} {nm} in {_dt(db[nm])}, the "
                             f"reference in {_dt(da[nm])}" + (f" (and {len(other) - 1} more)" if len(other) > 1
                                                              else "")))
            break
    if ref.autocast != cand.autocast:
        def computes(run: Recorded) -> str:
            return f"{run.autocast} (autocast)" if run.autocast else "its parameters' dtype"

        out.append(Cause("dtype", min(steps, default=s), f"the candidate's forward computes in {computes(cand)}, the "
                         f"reference's in {computes(ref)}: compare runs of one precision (a reference and its twin "
                         "made with the candidate's autocast)"))
    for t in sorted(set(ref.state_dtypes) & set(cand.state_dtypes)):
        if t > s:
            break
        a2, b2 = ref.state_dtypes[t], cand.state_dtypes[t]
        other2 = [(pn, sk) for pn in a2 if pn in b2 for sk in a2[pn] if sk in b2[pn] and a2[pn][sk] != b2[pn][sk]]
        if other2:
            pn, sk = other2[0]
            out.append(Cause("dtype", t, f"the candidate's optimizer keeps {sk} of {pn} in {b2[pn][sk]}, the "
                             f"reference's in {a2[pn][sk]} at step {t}" + (
                                 f" (and {len(other2) - 1} more)" if len(other2) > 1 else "")))
            break
    # the data
    for t in sorted(set(ref.data) & set(cand.data)):
        if t > s:
            break
        if ref.widths.get(t) != cand.widths.get(t):
            continue  # split or padded otherwise: these numbers are not comparable
        if ref.rows[t] != cand.rows[t]:
            out.append(Cause("data", t, f"the candidate's ranks together saw {cand.rows[t]} samples at step {t}, the "
                             f"reference {ref.rows[t]}: a data split that repeats or drops samples (a sampler "
                             "without the rank and world size, a batch size not divided by the ranks)"))
            break
        if any(abs(x - y) > 1e-6 * max(1, ref.rows[t]) for x, y in zip(ref.data[t], cand.data[t], strict=True)):
            out.append(Cause("data", t, f"the candidate's ranks together saw other samples than the reference at "
                             f"step {t} ({ref.rows[t]} of them, as many): a data split that gives ranks the same "
                             "samples, or another order or shuffle of the data"))
            break
    # a gradient the candidate's ranks disagree on
    for t in sorted(cand.rank_grads):
        if t > s:
            break
        per = cand.rank_grads[t]
        apart = _apart(per, cand.names, clipped_apart=bool(_clips_apart(cand.clips.get(t, {}))))
        if apart:
            nm = apart[0]
            vals = ", ".join(f"rank {r}: {g[nm]:.4g}" for r, g in sorted(per.items()) if nm in g)
            out.append(Cause("unreduced", t, f"the gradient of {nm} differs between the candidate's ranks at step {t} "
                             f"({vals}): not averaged over the ranks (a parameter outside DDP, a hand-written "
                             "all-reduce that misses it)" + (f"; {len(apart) - 1} more" if len(apart) > 1 else "")))
            break
    # clipping by each rank's own norm: ranks that clip the same (reduced) gradients compute one norm
    for t in sorted(cand.clips):
        if t > s:
            break
        norms_at = cand.clips[t]
        calls_apart = _clips_apart(norms_at)
        if calls_apart:
            vals = ", ".join(f"rank {r}: {v[calls_apart[0]]:.4g}" for r, v in sorted(norms_at.items()))
            out.append(Cause("clipping", t, "the gradients were clipped by another norm on each of the "
                             f"candidate's ranks at step {t} ({vals}): each rank clipped by its own gradients' norm, "
                             "not the global one (clip after the gradients are averaged; on shards, with a norm "
                             "all-reduced over them: FSDP's and DTensor's clip_grad_norm_ do)"))
            break
    # one factor on every gradient
    grads = {q: v for q, v in ref.norms.get(s, {}).items() if q.startswith("grad:")}
    factor = gradient_scale(grads, {q: v for q, v in cand.norms.get(s, {}).items() if q.startswith("grad:")})
    if factor is not None and n > 1 and abs(factor / n - 1) < 0.05:
        out.append(Cause("gradient_scale", s, f"every gradient is {factor:.3g}x the reference's ({cand.world} ranks "
                         f"against {ref.world}): summed over the ranks instead of averaged (a loss not divided by the "
                         "world size, or all_reduce SUM without the division)"))
    elif factor is not None and n > 1 and abs(factor * n - 1) < 0.05:
        out.append(Cause("gradient_scale", s, f"every gradient is 1/{1 / factor:.3g} of the reference's: divided by "
                         "the world size twice (an average of averages, or a loss divided by the world size before DDP "
                         "averages)"))
    elif factor is not None:
        out.append(Cause("gradient_scale", s, f"every gradient is {factor:.3g}x the reference's: a loss normalised by "
                         "another count (each rank's own tokens instead of the global batch's), or a loss or clipping "
                         "scaled differently"))
    # BatchNorm's statistics
    stats = sorted((t, q) for q, t in verdict.departed.items() if q.startswith("buffer:") and t <= s
                   and q.rsplit(".", 1)[-1] in ("running_mean", "running_var"))
    if stats:
        t, q = stats[0]
        out.append(Cause("batchnorm", t, f"BatchNorm's {q.split(':', 1)[1]} departs at step {t}: each rank normalises "
                         "by its own batch's statistics, the reference by the whole batch's (SyncBatchNorm keeps them "
                         "global)"))
    # the loss with the same parameters and data before it
    loss_at = verdict.loss_departs
    if loss_at is not None and loss_at <= s and not out:  # named only when nothing more direct explains it
        before = [q for q, t in verdict.departed.items() if q.startswith("param:") and t < loss_at]
        if not before:
            out.append(Cause("forward", loss_at, f"the loss departs at step {loss_at} while the parameters before it "
                             "agree" + (" and the data agrees" if loss_at in ref.data and loss_at in cand.data
                                        else "") + ": the forward computes otherwise per rank (dropout or other "
                             "randomness drawn per rank, a layer that normalises by each rank's batch)"))
    # the parameters with the same gradients
    if first.quantity.startswith("param:") and not any(q.startswith("grad:") and t <= s
                                                       for q, t in verdict.departed.items()) \
            and not out:
        out.append(Cause("update", s, f"the gradients agree at step {s} and {first.quantity.split(':', 1)[1]} after "
                         "its update does not: the optimizer's update differs (a hyperparameter not recorded, its "
                         "state, a step skipped or repeated)"))
    return sorted(out, key=lambda c: list(CAUSES).index(c.kind))


FLOOR_AHEAD = 8
"""A gradient's floor at any step is never below its norm at the first FLOOR_AHEAD recorded steps (the steps where
a running maximum has seen too little: a cancelling step 1)."""


def _scale_of_terms(by_step: Mapping[int, float]) -> dict[int, float]:
    """A gradient's size for its floor at each step: the largest finite norm it had at or before the step, or in the
    first FLOOR_AHEAD recorded steps (a gradient that grows later does not loosen its early floor)."""
    steps = sorted(by_step)
    early = max((v for t, v in by_step.items() if t in steps[:FLOOR_AHEAD] and math.isfinite(v)), default=0.0)
    out, running = {}, early
    for t in steps:
        if math.isfinite(by_step[t]):
            running = max(running, by_step[t])
        out[t] = running
    return out


def _module_scale(scales: Mapping[str, Mapping[int, float]]) -> dict[str, dict[int, float]]:
    """Each gradient's scale at each step raised to its module's largest (``grad:a.b.weight`` and ``grad:a.b.bias``
    are module ``a.b``'s). A sum that cancels exactly leaves only rounding, of its terms' size: a convolution's bias
    before BatchNorm, a key projection's bias under softmax, whose gradients are zero but for it; their own norms,
    noise at every step, say nothing of that size. Their terms are the module's backward signal, which its other
    gradients are built from."""
    modules: dict[str, list[str]] = {}
    for q in scales:  # grad:a.b.weight: module a.b; grad:weight: the root module's
        modules.setdefault(q.rsplit(".", 1)[0] if "." in q else q.split(":", 1)[0], []).append(q)
    out: dict[str, dict[int, float]] = {}
    for members in modules.values():
        for q in members:
            out[q] = {t: max(scales[m].get(t, 0.0) for m in members) for t in scales[q]}
    return out


def _clips_apart(norms_at: Mapping[int, list[float]]) -> list[int]:
    """The clipping calls (by their order in the step) whose norms the ranks disagree on."""
    calls = min((len(v) for v in norms_at.values()), default=0)
    return [i for i in range(calls) if len(norms_at) >= 2 and _spread([v[i] for v in norms_at.values()]) > 1e-6]


def _apart(per: Mapping[int, Mapping[str, float]], names: list[str], clipped_apart: bool = False) -> list[str]:
    """The gradients whose norms the ranks disagree on, the most apart first: each gradient's norm on each rank
    over its norm on the first rank, against 1. Where the ranks clipped by their own norms (``clipped_apart``),
    which scales every gradient of a rank by one factor, against the typical (median) ratio instead: a gradient
    never averaged is the one that leaves it (with fewer than three gradients the median says nothing: against
    1). A gradient that is 0 on the first rank and not on another is the furthest apart."""
    ranks = sorted(per)
    held = [nm for nm in names if all(nm in per[r] for r in ranks)]
    if len(ranks) < 2 or not held:
        return []
    off: dict[str, float] = {}
    ratios: dict[str, list[float]] = {}
    for nm in held:
        base = per[ranks[0]][nm]
        if base > 0:
            ratios[nm] = [per[r][nm] / base for r in ranks[1:]]
        elif any(per[r][nm] > 0 for r in ranks[1:]):
            off[nm] = math.inf
    typical = [sorted(v[i] for v in ratios.values())[len(ratios) // 2] if clipped_apart and len(ratios) >= 3
               else 1.0 for i in range(len(ranks) - 1)]
    for nm, v in ratios.items():
        off[nm] = max(abs(x / m - 1) if m > 0 else math.inf for x, m in zip(v, typical, strict=True))
    return sorted((nm for nm, v in off.items() if v > 1e-6), key=lambda nm: -off[nm])


def _holders(by_step: Mapping[int, list[float]], streams: Mapping[Any, list[dict]]) -> int:
    """How many ranks hold a value kept by step in ``by_step``: the most any step has (each rank adds one per step).
    Not the world: a pipeline's first stages compute no loss."""
    return max((len(v) for v in by_step.values()), default=len(streams))


def _dt(d: str) -> str:
    return d.replace("torch.", "")


def _spread(vals: list[float]) -> float:
    """The relative spread of values the ranks should agree on bit for bit (a reduced gradient's norm)."""
    top = max(abs(v) for v in vals)
    return (max(vals) - min(vals)) / top if top > 0 else 0.0

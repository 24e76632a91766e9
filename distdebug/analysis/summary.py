"""Summarise a run: per-rank progress and all findings, merged across ranks.

Works on partial runs: a rank without an ``end`` record is reported as ended without a record
(killed, or still running), and its steps up to then are used as they are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from distdebug.analysis import cost, costmodel, overhead
from distdebug.analysis.errors import error_findings
from distdebug.analysis.incidents import Incident
from distdebug.analysis.incidents import group as group_incidents
from distdebug.analysis.traces import analyze_run
from distdebug.artifacts import layout, retention, schema
from distdebug.artifacts.reader import Run
from distdebug.doctor.volume import summary_text as volume_summary
from distdebug.findings import Finding, Severity, ranks_text


@dataclass
class RankSummary:
    rank: int
    """The global rank."""
    node: int | None
    """The node (``--node-rank``) the rank ran on."""
    host: str | None
    """The host name the rank ran on."""
    steps: int
    """Optimizer steps the rank completed."""
    first_loss: float | None
    """The loss at the rank's first step (None: no loss seen)."""
    last_loss: float | None
    """The loss at its last step."""
    median_step_time_s: float | None
    """The median of its steps' times, in seconds."""
    findings: int
    """How many findings name this rank."""
    status: str
    """``exit 0``, ``exit N``, ``script raised X`` or ``no end record (killed or still running)``; and where the
    rank's writes failed (a full disk), from which step and why."""
    wrapper: str | None = None
    """The wrapper its model ran in (DDP, FSDP2, DeepSpeed, ...)."""
    damaged_lines: int = 0
    """Unreadable lines skipped in its event stream (a cut-off last line is not counted)."""
    memory_peak: dict[str, Any] | None = None
    """Bytes at this rank's largest step: parameters, gradients, optimizer_state, activations, other."""
    straggler_score: float | None = None
    """Fastest rank's median work over this rank's (1.0: as fast as the fastest), from rank 0's last scores."""


@dataclass
class RunSummary:
    run_dir: str
    """The run directory read (the first, for a job merged from several nodes' directories)."""
    command: list[str] | None
    """The attach command line as given (secrets redacted)."""
    world_size: int | None
    """Ranks in the job (from the manifest; the ranks' own records where it lacks it)."""
    exit_code: int | None
    """The job's exit code as attach returned it; None while it runs or when it was killed."""
    failure: str | None
    """Why the job failed, in a few words (a rank that raised, a hang ended by attach), where it did."""
    ranks: list[RankSummary] = field(default_factory=list)
    """One entry per rank, in rank order."""
    findings: list[Finding] = field(default_factory=list)
    """Every finding, each rank's last attempt and the run-level verdicts, most severe first; one per (detector,
    step, subject) with the union of the ranks."""
    run_dirs: list[str] = field(default_factory=list)
    """Every directory read: one, or one per node for a job whose nodes share no file system."""
    incidents: list[Incident] = field(default_factory=list)
    """The findings grouped by shared cause, the root first (analysis.incidents)."""
    discovery: dict[str, Any] | None = None
    """What rank 0 discovered in the script: models, optimizers, the wrapper (DDP, FSDP2, DeepSpeed...), the
    parallel layout."""
    injected: list[dict[str, Any]] = field(default_factory=list)
    """Faults injected on purpose (attach --inject), as each rank recorded them acting."""
    never_acted: list[str] = field(default_factory=list)
    """Faults given to attach --inject that no rank recorded acting, or whose act was undone (``not_acted``
    records): said, so that a clean report is not read as the fault being missed."""
    why_not: dict[str, list[str]] = field(default_factory=dict)
    """Fault -> its own reasons for not acting, with the ranks that gave each (``not_acted`` records)."""
    windows: list[dict[str, Any]] = field(default_factory=list)
    """Profiler windows (analysis.traces.analyze_window each): shares, overlap, top operators, verdicts."""
    warnings: list[str] = field(default_factory=list)
    """Damage in the run directory (unreadable manifest, skipped lines)."""
    thinned: list[str] = field(default_factory=list)
    """What the run-directory budget thinned (artifacts.retention), one line per group of ranks alike:
    ``ranks 0-1: steps 1,000-119,999 (119,000 steps): summaries per 1,000 steps; ...``."""
    disk: list[str] = field(default_factory=list)
    """Per node, what the log-volume guard predicted each destination would write an hour beside what was then
    written, and when each file system would fill (launch.volume, doctor.volume.summary_text)."""
    harness_cost: dict[str, Any] | None = None
    """What the harness cost each rank per step (analysis.cost.summarize_cost), from its own accounting."""
    overhead: dict[str, Any] | None = None
    """``attach --measure-overhead``'s in-job A/B (analysis.overhead.summarize_ab): fraction, ci, steps..."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["findings"] = [f.to_dict() for f in self.findings]
        d["incidents"] = [i.to_dict() for i in self.incidents]
        return d


def _merge(findings: list[Finding]) -> list[Finding]:
    """One finding per (detector, step, subject, message) with the union of ranks, most severe first."""
    merged: dict[tuple, Finding] = {}
    for f in findings:
        key = (f.detector, f.step, f.subject, f.message if f.detector == "harness" else "")
        if key in merged:
            have = merged[key]
            have.ranks = sorted(set(have.ranks) | set(f.ranks))
        else:
            merged[key] = Finding.from_dict(f.to_dict())
    return sorted(
        merged.values(),
        key=lambda f: (-Severity(f.severity).order, f.step if f.step is not None else -1, f.detector, f.subject),
    )


def summarize(run: Run) -> RunSummary:
    ranks: list[RankSummary] = []
    findings: list[Finding] = []
    injected: list[dict[str, Any]] = []
    not_acted: list[dict[str, Any]] = []
    straggler_scores: dict[int, float] = {}
    discovery = None
    world_size = None
    per_rank_layout: dict[int, dict[str, Any]] = {}
    costs: dict[int, dict[str, Any]] = {}
    blocks: dict[int, list[dict[str, Any]]] = {}
    off_paid: dict[int, float | None] = {}
    thinned: dict[str, list[int]] = {}
    for rank, stream in sorted(run.ranks.items()):
        records = stream.last_attempt()
        said = thinned_text(stream.records, layout.rank_dir(run.dir_of(rank), rank))
        if said:
            thinned.setdefault(said, []).append(rank)
        start = next((r for r in records if r.get("kind") == schema.START), {})
        world_size = world_size or start.get("world_size")
        digest = stream.digest  # the per-step figures, however the stream was read (artifacts.digest)
        injected += [r for r in records if r.get("kind") == schema.INJECTED]
        not_acted += [r for r in records if r.get("kind") == schema.NOT_ACTED]
        disc = next((r for r in records if r.get("kind") == schema.DISCOVERY), None)
        if disc is not None and discovery is None:
            discovery = {k: disc.get(k) for k in ("models", "optimizers", "process_group", "step_source", "layout")}
        if disc is not None and isinstance(disc.get("layout"), dict):
            per_rank_layout[rank] = disc["layout"]
        rank_findings = [Finding.from_dict(r) for r in records if r.get("kind") == schema.FINDING]
        findings.extend(rank_findings)
        end = next((r for r in records if r.get("kind") == schema.END), None)
        error = next((r for r in records if r.get("kind") == schema.SCRIPT_ERROR), None)
        if error is not None:
            status = f"script raised {error.get('exception')}"
            findings.extend(error_findings(rank, error))
        elif end is not None:
            status = f"exit {end.get('exit_code')}"
        else:
            status = "no end record (killed, or still running)"
        failed = next((r for r in records if r.get("kind") == schema.WRITE_FAILED), None)
        if failed is not None:  # a full or failing disk: what is missing after it is not the rank's doing
            since = f"step {failed['step']}" if failed.get("step") is not None else "its start"
            if end is None and error is None:
                status = "no end record: the disk took none (not necessarily a kill)"
            status += (f"; its writes failed from {since} ({failed.get('error')}): only findings, stalls and the end "
                       "kept")
            if end is not None and end.get("write_errors"):
                status += f", {end['write_errors']} records lost"
        models = (disc or {}).get("models") or []
        peaks = [r for r in records if r.get("kind") == schema.MEMORY_PEAK]
        peak = peaks[-1] if peaks else digest.memory_max  # a killed rank has no peak record
        blocks[rank] = [r for r in records if r.get("kind") == schema.OVERHEAD_BLOCK]
        off_paid[rank] = cost.off_paid_ms(digest.harness_cost)
        rank_cost = cost.per_rank(digest.harness_cost, digest.work_median_ms(), digest.traced,
                                  [r for r in records if r.get("kind") == schema.TRACE])
        if rank_cost is not None:
            costs[rank] = rank_cost
        if digest.straggler is not None:
            straggler_scores = {int(k): v.get("score") for k, v in (digest.straggler.get("ranks") or {}).items()}
        ranks.append(
            RankSummary(
                rank=rank,
                node=start.get("node"),
                host=start.get("host"),
                steps=digest.last_step or 0,
                first_loss=digest.first_loss,
                last_loss=digest.last_loss,
                median_step_time_s=digest.median_step_time_s(),
                findings=len(rank_findings),
                status=status,
                wrapper=models[0].get("wrapper") if models else None,
                damaged_lines=stream.damaged_lines,
                memory_peak={k: v for k, v in peak.items() if k not in ("v", "kind", "rank", "time")} if peak else None,
            )
        )
    for r in ranks:
        r.straggler_score = straggler_scores.get(r.rank)
    findings.extend(Finding.from_dict(r) for r in run.findings if r.get("kind") == schema.FINDING)
    exit_code = None
    failure = None
    for node in run.nodes.values():
        if node.get("exit_code") is not None:
            exit_code = node["exit_code"] if exit_code in (None, 0) else exit_code
        failure = failure or node.get("message")
    manifest = run.manifest or {}
    merged = _merge(findings)
    ab = overhead.summarize_ab(blocks, off_paid)
    dirs = run.paths or [run.path]
    silent = never_acted(manifest.get("faults"), injected, not_acted)
    return RunSummary(
        run_dir=str(run.path),
        command=manifest.get("command"),
        world_size=world_size,
        exit_code=exit_code,
        failure=failure,
        ranks=ranks,
        injected=injected,
        never_acted=silent,
        why_not=why_not(silent, not_acted),
        windows=[w for path in dirs for w in analyze_run(path)],
        run_dirs=[str(p) for p in dirs],
        findings=merged,
        incidents=group_incidents(merged),
        discovery=_with_layouts(discovery, per_rank_layout),
        warnings=list(run.warnings),
        thinned=[f"{ranks_text(r)}: {text}" for text, r in thinned.items()],
        disk=[f"node {k}: {t}" for k, node in sorted(run.nodes.items())
              if (t := volume_summary(node.get("volume"))) is not None],
        harness_cost=_with_model(cost.summarize_cost(costs), discovery, ab),
        overhead=ab,
    )


def _with_model(harness_cost: dict[str, Any] | None, discovery: dict[str, Any] | None,
                ab: dict[str, Any] | None) -> dict[str, Any] | None:
    """The job's cost model (analysis.costmodel) for the rank the cost is said of, under ``model``."""
    if harness_cost is None:
        return None
    rank = str(harness_cost["rank"])
    model = costmodel.assess(discovery, harness_cost["ranks"].get(rank), ((ab or {}).get("ranks") or {}).get(rank))
    return {**harness_cost, "model": model} if model is not None else harness_cost


def thinned_text(records: list[dict[str, Any]], rank_dir: Path) -> str | None:
    """What the run-directory budget thinned on one rank: the steps summarised (and by how many steps a
    summary) and the steps whose fingerprints were kept as one digest; None when nothing was. The summaries'
    numbers come from the thinner's ``events.thinned.json`` where it wrote one (a rank read through its index
    has not read its thinned file), else from the records."""
    from distdebug.artifacts.reader import read_json

    stats = read_json(rank_dir / layout.THINNED_STATS) or retention.window_stats(records)
    parts = []
    if stats and stats.get("summaries"):
        a, b = int(stats["smallest"]), int(stats["largest"])
        per = f"{a:,}" if a == b else f"{a:,} to {b:,}"
        parts.append(f"steps {stats['first']:,}-{stats['last']:,}: {int(stats['steps']):,} of them kept as "
                     f"{int(stats['summaries']):,} summaries of {per} steps (loss, step time: min/median/max), the "
                     "steps around each finding whole")
    size = layout.FINGERPRINT_ROOT_BYTES
    try:  # the first and last digest's steps: two reads, however many steps (a thousand ranks' report)
        with open(rank_dir / layout.FINGERPRINT_ROOTS, "rb") as f:
            first = f.read(8)
            n = f.seek(0, 2) // size
            f.seek((n - 1) * size)
            last = f.read(8)
    except (OSError, ValueError):
        n = 0
    if n:
        a, b = int.from_bytes(first, "little", signed=True), int.from_bytes(last, "little", signed=True)
        parts.append(f"fingerprints of steps {a:,}-{b:,}: {n:,} of them kept as one digest each (diff tells whether "
                     "ranks agreed there, not on which tensor)")
    return "; ".join(parts) or None


def _with_layouts(discovery: dict[str, Any] | None, per_rank: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """Rank 0's layout, with what differs per rank: each rank's data-parallel group and pipeline stage."""
    if discovery is None or not isinstance(discovery.get("layout"), dict):
        return discovery
    layout = dict(discovery["layout"])
    layout["data_parallel_groups"] = {str(r): lay.get("data_parallel_group") for r, lay in per_rank.items()}
    stages = {str(r): lay["pipeline"].get("indices") or [lay["pipeline"]["index"]]
              for r, lay in per_rank.items() if lay.get("pipeline")}
    if stages:
        layout["pipeline_stages"] = stages
    layout["job_label"] = _job_label(layout, per_rank)
    return {**discovery, "layout": layout}


def _job_label(layout: dict[str, Any], per_rank: dict[int, dict[str, Any]]) -> str:
    """The layout said for the whole job: rank 0's label names its own group and its own pipeline stage
    (``..., gradients all-reduced by hand over ranks [0, 2], pipeline stage 0 of 2``); the job's names
    every data-parallel group and every rank's stage."""
    label = str(layout.get("label") or "")
    own = layout.get("data_parallel_group")
    groups = sorted({tuple(g) for g in (lay.get("data_parallel_group") for lay in per_rank.values()) if g})
    if own and len(groups) > 1:
        label = label.replace(f"over ranks {own}", f"within data-parallel groups {[list(g) for g in groups]}")
    pipeline = layout.get("pipeline")
    stages = layout.get("pipeline_stages") or {}
    if pipeline and stages:
        own = stages.get("0") or [pipeline.get("index")]
        tail = f"pipeline stage {', '.join(str(i) for i in own)} of {pipeline.get('stages')}"
        if label.endswith(tail):
            label = label[: -len(tail)] + f"pipeline of {pipeline.get('stages')} stages (" + ", ".join(
                f"rank {r}: stage{'s' if len(i) > 1 else ''} {', '.join(str(x) for x in i)}"
                for r, i in sorted(stages.items(), key=lambda x: int(x[0]))) + ")"
    return label


def never_acted(faults: Any, injected: list[dict[str, Any]], not_acted: Any = ()) -> list[str]:
    """Names of the faults the manifest lists (``{"target": "fault_injection.NAME:Class", ...}``, one module
    per fault) that did not act (``acted``); the replay's probe (which acts on nothing) is not one."""
    done = acted(injected, not_acted)
    names = [str(f.get("target", "")).partition(":")[0].rpartition(".")[2] for f in faults or []
             if isinstance(f, dict)]
    return [n for n in dict.fromkeys(names) if n and n != "probe" and n not in done]


def acted(injected: list[dict[str, Any]], not_acted: Any = ()) -> set[str]:
    """The faults whose act held on some rank: an ``injected`` record of that rank and no ``not_acted`` record
    of the same rank at the act's step or later. A reason given at or after the act says that what the fault
    did was undone (a flipped bit rewritten, a NaN that never reached the loss); one given before it is a
    decline the fault went past (no model yet, then one in a later phase)."""
    said: dict[tuple[str, Any], list[int]] = {}
    for n in not_acted:
        step = n.get("step")
        said.setdefault((str(n.get("fault")), n.get("rank")), []).append(step if isinstance(step, int) else 0)
    out = set()
    for i in injected:
        key = (str(i.get("fault")), i.get("rank"))
        at = i.get("step")
        step = at if isinstance(at, int) else 0
        if not any(s >= step for s in said.get(key, ())):
            out.add(key[0])
    return out


def why_not(names: list[str], not_acted: Any) -> dict[str, list[str]]:
    """Each named fault's own reasons for not acting, in the order first given, each with the ranks that gave
    it (``"no other rank holds head.weight ... [rank 1]"``); a fault that gave none is left out."""
    ranks: dict[str, dict[str, list[int]]] = {}
    for n in not_acted:
        name, reason = str(n.get("fault")), str(n.get("reason") or "")
        if name in names and reason:
            got = ranks.setdefault(name, {}).setdefault(reason, [])
            if isinstance(n.get("rank"), int) and n["rank"] not in got:
                got.append(n["rank"])
    return {name: [f"{reason} [{ranks_text(rs)}]" for reason, rs in by.items()] for name, by in ranks.items()}


NO_REASON = "nothing it acts through was there, or its step never came"
"""Said of a fault that did not act and gave no reason of its own (a run from before faults gave them)."""


def never_acted_text(names: list[str], why: dict[str, list[str]]) -> str:
    """``bitflip_param: no other rank holds head.weight ... [rank 1]``: each fault with its own reasons, or the
    generic line for one that gave none."""
    return "; ".join(f"{n}: {'; '.join(why[n])}" if why.get(n) else f"{n} ({NO_REASON})" for n in names)

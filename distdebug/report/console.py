"""Terminal report: findings first (most severe first), then per-rank progress."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape as esc
from rich.table import Table

from distdebug import cards, strictjson
from distdebug.analysis.costmodel import describe as describe_model
from distdebug.analysis.overhead import describe as describe_overhead
from distdebug.analysis.summary import RunSummary
from distdebug.report.fmt import memory_mb, number, one_off_text, rank_list
from distdebug.report.knowledge import advise_all, findings_with_advice, incidents_with_advice, shown_fix

SEVERITY_STYLE = {"critical": "bold white on red", "error": "bold red", "warning": "yellow", "info": "cyan"}


def render(summary: RunSummary, console: Console | None = None) -> None:
    # Piped output defaults to 80 columns, which folds every row of a per-rank table.
    console = console or Console(width=None if Console().is_terminal else 140)
    console.print(f"[bold]distdebug report[/bold]  {esc(summary.run_dir)}")
    if len(summary.run_dirs) > 1:
        console.print(f"merged from {len(summary.run_dirs)} run directories (one per node): "
                      + esc(", ".join(summary.run_dirs)))
    if summary.command:
        console.print(f"command: {esc(' '.join(summary.command))}")
    disc = summary.discovery or {}
    models = disc.get("models") or []
    pg = disc.get("process_group") or {}
    parts = [f"world size {summary.world_size or '?'}"]
    if pg:
        parts.append(f"backend {pg.get('backend')}")
    for m in models:
        parts.append(f"model {m.get('class')} ({m.get('wrapper')}, {m.get('parameters', '?')} parameters)")
    for o in disc.get("optimizers") or []:
        parts.append(f"optimizer {o.get('class')}")
    if disc.get("step_source"):
        parts.append(f"steps from {disc['step_source']}")
    console.print(esc("; ".join(parts)))
    layout = disc.get("layout") or {}
    label = str(layout.get("job_label") or layout.get("label") or "")
    if label and not label.startswith("data parallel over"):
        console.print(f"layout: {esc(label)}")
    for inj in summary.injected:
        what = ", ".join(f"{k} {v}" for k, v in inj.items() if k not in ("v", "kind", "rank", "time", "fault", "step"))
        console.print(f"[magenta]fault injected on purpose[/magenta]: {esc(str(inj.get('fault')))} on rank "
                      f"{inj.get('rank')} at step {inj.get('step')}" + (f" ({esc(what)})" if what else ""))
    for name in summary.never_acted:
        why = summary.why_not.get(name)  # the fault's own reasons; the generic line only when it gave none
        console.print(f"[magenta]fault injected on purpose[/magenta]: {esc(name)} [bold]never acted[/bold]: "
                      + (esc("; ".join(why)) if why else "nothing it acts through was there, or its step never came "
                         "(distdebug faults replay SCRIPT says which faults can act on a script)"))
    if summary.exit_code is not None:
        style = "green" if summary.exit_code == 0 else "bold red"
        tail = f" ({esc(summary.failure)})" if summary.failure else ""
        console.print(f"exit code: [{style}]{summary.exit_code}[/{style}]{tail}")

    if summary.incidents:
        render_incidents(summary, console)
    if summary.findings:
        table = Table(title=f"Findings ({len(summary.findings)})", show_lines=False)
        for col in ("severity", "detector", "rank(s)", "step", "subject", "message"):
            table.add_column(col, overflow="fold")
        advice = advise_all(summary.findings, run_dir=summary.run_dir, incidents=summary.incidents)
        for f, a in zip(summary.findings, advice, strict=True):
            sev = f.severity.value
            # Messages quote errors and paths ("[/__w/pytorch/...]"): text, never markup.
            msg = esc(f.message) + (f"\n[dim]likely cause: {esc(a.cause)}[/dim]" if a.cause else "") + \
                (f"\n[dim]check: {esc(a.check)}[/dim]" if a.check else "") + \
                (f"\n[dim]fix: {esc(shown_fix(f.fix, a))}[/dim]" if shown_fix(f.fix, a) else "")
            table.add_row(f"[{SEVERITY_STYLE[sev]}]{sev}[/]", esc(_coded(f.detector)), rank_list(f.ranks),
                          "-" if f.step is None else str(f.step), esc(f.subject), msg)
        console.print(table)
    else:
        console.print("[green]No findings.[/green]")

    shown = notable_ranks(summary)
    hidden = len(summary.ranks) - len(shown)
    table = Table(title="Ranks" + (f" (the {len(shown)} worth a look of {len(summary.ranks)}; --json or --html for "
                                   "all)" if hidden else ""))
    for col in ("rank", "node", "host", "steps", "first loss", "last loss", "median step (ms)", "speed score",
                "peak memory (MB): params / grads / optim / activations", "findings", "status"):
        table.add_column(col, justify="right" if col not in ("host", "status") else "left")
    for r in shown:
        ms = None if r.median_step_time_s is None else r.median_step_time_s * 1000
        status = esc(r.status) + (f" [dim]({r.damaged_lines} damaged lines)[/dim]" if r.damaged_lines else "")
        style = "" if r.status == "exit 0" else "[yellow]"
        table.add_row(str(r.rank), "-" if r.node is None else str(r.node), esc(r.host or "-"), str(r.steps),
                      number(r.first_loss), number(r.last_loss), number(ms, 3), number(r.straggler_score, 3),
                      memory_mb(r.memory_peak), str(r.findings),
                      f"{style}{status}" if style else status)
    console.print(table)
    for line in summary.thinned:
        console.print(f"[dim]thinned by the run-directory budget[/dim]: {esc(line)}")
    for line in summary.disk:
        console.print(f"[dim]disk[/dim]: {esc(line)}")
    _cost(console, summary.harness_cost)
    if summary.overhead:
        console.print(esc(describe_overhead(summary.overhead)))
    _windows(console, summary.windows)


def _cost(console: Console, cost: dict[str, Any] | None) -> None:
    """``harness cost per step``: the costliest rank's own accounting (analysis.cost)."""
    if not cost:
        return
    r = cost["ranks"][str(cost["rank"])]
    median = r.get("median_step_ms")
    share = f" = {cost['fraction']:.1%} of its median step ({median:.2f} ms)" if cost.get("fraction") is not None \
        and median else ""
    parts = ", ".join(f"{k} {v:.3f}" for k, v in r["per_step_ms"].items() if v >= 0.0005)
    threads = ", ".join(f"{k.removeprefix('distdebug-')} {v:.3f}" for k, v in r["threads_cpu_per_step_ms"].items())
    console.print(f"harness cost per step (rank {cost['rank']}, over {r['steps']} steps), steady: "
                  f"{r['total_per_step_ms']:.3f} ms on the training thread{esc(share)}"
                  + (f" [dim]({esc(parts)})[/dim]" if parts else "")
                  + (f"; background threads' CPU {esc(threads)} ms" if threads else "")
                  + f"; host reads {r['host_reads_per_step']:g} per step; " + esc(one_off_text(r)))
    if cost.get("model"):
        console.print(esc(describe_model(cost["model"])))
    if cost.get("advice"):
        console.print(f"[yellow]{esc(cost['advice'])}[/yellow]")


MAX_RANK_ROWS = 32


def notable_ranks(summary: RunSummary, limit: int = MAX_RANK_ROWS) -> list:
    """Every rank for small jobs; for large ones the ranks worth a look at 3 a.m.: those with
    findings or that did not finish, then the slowest and the lowest speed scores, in rank order."""
    ranks = summary.ranks
    if len(ranks) <= limit:
        return list(ranks)
    pick = {r.rank for r in ranks if r.findings or r.status != "exit 0"}
    timed = sorted((r for r in ranks if r.median_step_time_s is not None), key=lambda r: -(r.median_step_time_s or 0.0))
    scored = sorted((r for r in ranks if r.straggler_score is not None), key=lambda r: r.straggler_score or 0.0)
    pick |= {r.rank for r in timed[:3]} | {r.rank for r in scored[:3]}
    return [r for r in ranks if r.rank in pick][:max(limit, 8)]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _windows(console: Console, windows: list[dict]) -> None:
    if not windows:
        return
    table = Table(title="Profiler windows (median over ranks, min-max)")
    for col in ("steps", "ranks", "overlap of comm with compute", "comm share", "data loader share",
                "top operator (rank 0)", "verdict", "traces"):
        table.add_column(col, overflow="fold")
    for w in windows:
        s = w["summary"]
        cells = []
        for key in ("overlap_ratio", "comm_share", "data_share"):
            cells.append(f"{_pct(s.get(key))} ({_pct(s.get(key + '_min'))}-{_pct(s.get(key + '_max'))})")
        first: dict[str, Any] = next(iter(w["ranks"].values()), {})
        top = (first.get("top_ops") or [{}])[0]
        table.add_row(f"{w['steps'][0]}-{w['steps'][1]}" if w.get("steps") else "?", str(len(w["ranks"])), *cells,
                      esc(f"{top.get('name', '-')} ({top.get('total_us', 0) / 1000:.1f} ms)") if top else "-",
                      esc("; ".join(w["verdicts"]) or "healthy"), esc(w["dir"]))
    console.print(table)


def render_incidents(summary: RunSummary, console: Console) -> None:
    """The first screen: one block per incident (warnings and worse; notes counted), its root's message,
    what followed from it, and one fix."""
    shown = [i for i in incidents_with_advice(summary.incidents, summary.findings, run_dir=summary.run_dir)
             if i["severity"] != "info"]
    notes = len(summary.incidents) - len(shown)
    console.print(f"[bold]Incidents ({len(shown)})[/bold]" + (f"  and {notes} note(s) below" if notes else ""))
    for n, inc in enumerate(shown, 1):
        sev, root = inc["severity"], inc["root"]
        step = "" if root["step"] is None else f" step {root['step']}"
        console.print(f"{n}. [{SEVERITY_STYLE[sev]}]{sev}[/] {esc(_coded(inc['title']))} (rank(s) "
                      f"{rank_list(root['ranks'])}"
                      f"{step}): {esc(root['message'])}")
        for m in inc["members"][1:]:
            mstep = "" if m["step"] is None else f" step {m['step']}"
            console.print(f"   then {esc(m['severity'])} {esc(_coded(m['detector']))} {esc(m['subject'])} (rank(s) "
                          f"{rank_list(m['ranks'])}{mstep})")
        if inc["fix"]:
            console.print(f"   [bold]fix[/bold]: {esc(inc['fix'])}")
        if root.get("code"):
            console.print(f"   [dim]what it means: distdebug explain {root['code']}[/dim]")


def _coded(text: str) -> str:
    """``nan_origin...`` -> ``DD102 nan_origin...``: a finding's code before its detector (a plugin's has none)."""
    card = cards.get(text.split(":")[0])
    return f"{card.code} {text}" if card is not None else text


def render_json(summary: RunSummary) -> str:
    """The summary; each finding with its ``advice`` (symptom, likely cause, check, fix); ``incidents``: the
    findings grouped by shared cause, each with its root, members and one fix."""
    d = summary.to_dict()
    d["findings"] = findings_with_advice(summary.findings, run_dir=summary.run_dir, incidents=summary.incidents)
    d["incidents"] = incidents_with_advice(summary.incidents, summary.findings, run_dir=summary.run_dir)
    return strictjson.dumps(d, indent=2, default=str)

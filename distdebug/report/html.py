"""Self-contained HTML report: one file, styles, script and data inline, nothing fetched.

Tables (findings with their likely cause and fix, ranks, profiler windows) are written here as
plain HTML, so they read even with scripts off; the plots are drawn by ``assets/report.js`` from
the JSON that ``distdebug.analysis.plots`` prepares (already aggregated for large jobs). Links to
the profiler traces are relative to where the report is written, so the report and the run
directory can be copied together.
"""

from __future__ import annotations

import datetime
import html
import os
from importlib import resources
from pathlib import Path
from typing import Any

from distdebug import cards, strictjson
from distdebug.analysis.costmodel import describe as describe_model
from distdebug.analysis.overhead import describe as describe_overhead
from distdebug.analysis.plots import plot_data
from distdebug.analysis.summary import RunSummary
from distdebug.artifacts import layout
from distdebug.artifacts.reader import Run, read_json
from distdebug.report import cardview
from distdebug.report.fmt import memory_mb, number, one_off_text, rank_list
from distdebug.report.knowledge import findings_with_advice, incidents_with_advice

MAX_RANK_ROWS = 64
"""Ranks listed openly; beyond, the table is folded (the plots carry the picture)."""
PLOTS = [
    ("loss", "Loss per rank", "One line per rank (or the spread over ranks for large jobs); "
     "\u00d7 marks a NaN/Inf loss; the dashed line is the first step with an error."),
    ("step_time", "Step time heatmap (rank \u00d7 step)", "Colour: ratio to the median step time. In "
     "synchronous training every rank waits for the slowest, so a slow step darkens a whole column (the "
     "straggler scores say whose fault); a row darker than the rest spends longer outside the collectives."),
    ("timeline", "Timeline of findings", "Divergence, NaN, spikes and hangs by step; the first bad step marked."),
    ("memory", "Memory at each rank's peak", "Parameters, gradients, optimizer state, activations (and other "
     "GPU memory) at the step each rank used most."),
    ("straggler", "Straggler scores", "Fastest rank's median work divided by each rank's: under the threshold, "
     "every other rank waits for it."),
    ("sweep", "all_reduce bus bandwidth", "distdebug doctor --bandwidth: busbw = algbw \u00d7 2(n-1)/n, as "
     "nccl-tests."),
    ("links", "Link matrix (send/recv GB/s)", "Each pair of ranks; slow pairs outlined."),
]


def _asset(name: str) -> str:
    return resources.files("distdebug.report").joinpath("assets").joinpath(name).read_text(encoding="utf-8")


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def _findings_table(findings: list[dict[str, Any]]) -> str:
    if not findings:
        return "<p>No findings.</p>"
    rows = []
    for f in findings:
        a = f["advice"]
        advice = "".join(
            f"<div class='advice'><b>{label}:</b> {_e(text)}</div>"
            for label, text in (("seen as", a["symptom"]), ("likely cause", a["cause"]), ("check", a["check"]),
                                ("fix", a["fix"] if a.get("consequence_of") else f.get("fix") or a["fix"])) if text)
        rows.append(
            f"<tr><td><span class='sev {_e(f['severity'])}'>{_e(f['severity'])}</span></td><td>{_code(f)}"
            f"{_e(f['detector'])}</td>"
            f"<td>{_e(rank_list(f['ranks']))}</td><td class='num'>{_e('-' if f['step'] is None else f['step'])}</td>"
            f"<td><code>{_e(f['subject'])}</code></td><td>{_e(f['message'])}{advice}</td></tr>")
    return ("<table class='findings'><tr><th>severity</th><th>detector</th><th>rank(s)</th><th>step</th>"
            "<th>subject</th><th>what, likely cause, check, fix</th></tr>" + "".join(rows) + "</table>")


def _code(f: dict[str, Any]) -> str:
    """A finding's code, linked to its card at the foot of the page (the page stays one self-contained file)."""
    code = f.get("code")
    return f"<a class='code' href='#{_e(code)}'>{_e(code)}</a> " if code else ""


def _cards(findings: list[dict[str, Any]]) -> str:
    """The cards of the kinds of finding on this page: what each means, its causes, the check and the fix."""
    names = sorted({f["detector"] for f in findings if f.get("code")}, key=lambda n: cards.CARDS[n].code)
    if not names:
        return ""
    return ("<section><h2>What these findings mean</h2>"
            + "".join(cardview.html_block(cards.CARDS[n]) for n in names) + "</section>")


def _merged(summary: RunSummary) -> str:
    if len(summary.run_dirs) < 2:
        return ""
    return f"merged from {len(summary.run_dirs)} run directories (one per node): {_e(', '.join(summary.run_dirs))}<br>"


def _incidents(summary: RunSummary) -> str:
    """Incidents: the findings grouped by shared cause, each with its root, what followed and one fix."""
    incs = incidents_with_advice(summary.incidents, summary.findings, run_dir=summary.run_dir)
    if not incs:
        return ""
    items = []
    for inc in incs:
        root = inc["root"]
        then = "".join(f"<li>{_e(m['severity'])} {_code(m)}{_e(m['detector'])} <code>{_e(m['subject'])}</code> rank(s) "
                       f"{_e(rank_list(m['ranks']))} step {_e('-' if m['step'] is None else m['step'])}: "
                       f"{_e(m['message'])}</li>" for m in inc["members"][1:])
        items.append(f"<li class='incident'><span class='sev {_e(inc['severity'])}'>{_e(inc['severity'])}</span> "
                     f"{_code(root)}<b>{_e(inc['title'])}</b> rank(s) {_e(rank_list(root['ranks']))} step "
                     f"{_e('-' if root['step'] is None else root['step'])}: {_e(root['message'])}"
                     + (f"<ul>{then}</ul>" if then else "")
                     + (f"<div class='advice'><b>fix:</b> {_e(inc['fix'])}</div>" if inc["fix"] else "") + "</li>")
    return f"<section><h2>Incidents ({len(incs)}), root cause first</h2><ol>{''.join(items)}</ol></section>"


def _ranks_table(summary: RunSummary) -> str:
    head = ("<table class='ranks'><tr><th>rank</th><th>node</th><th>host</th><th>steps</th><th>first loss</th>"
            "<th>last loss</th><th>median step (ms)</th><th>speed score</th><th>peak memory (MB): params / grads / "
            "optim / activations</th><th>findings</th><th>status</th></tr>")
    rows = []
    for r in summary.ranks:
        ms = None if r.median_step_time_s is None else r.median_step_time_s * 1000
        rows.append(f"<tr><td class='num'>{r.rank}</td><td class='num'>{_e('-' if r.node is None else r.node)}</td>"
                    f"<td>{_e(r.host or '-')}</td><td class='num'>{r.steps}</td><td class='num'>{number(r.first_loss)}"
                    f"</td><td class='num'>{number(r.last_loss)}</td><td class='num'>{number(ms, 3)}</td>"
                    f"<td class='num'>{number(r.straggler_score, 3)}</td>"
                    f"<td class='num'>{_e(memory_mb(r.memory_peak))}</td>"
                    f"<td class='num'>{r.findings}</td><td>{_e(r.status)}"
                    + (f" ({r.damaged_lines} damaged lines)" if r.damaged_lines else "") + "</td></tr>")
    table = head + "".join(rows) + "</table>" + "".join(
        f"<p class='dim'>thinned by the run-directory budget: {_e(line)}</p>" for line in summary.thinned) + "".join(
        f"<p class='dim'>disk: {_e(line)}</p>" for line in summary.disk)
    if len(rows) > MAX_RANK_ROWS:
        odd = sum(1 for r in summary.ranks if r.findings or r.status != "exit 0")
        return (f"<details><summary>{len(rows)} ranks ({odd} with findings or not finished): show all</summary>"
                f"{table}</details>")
    return table


def _href(path: str, out_dir: Path) -> str:
    try:
        rel = os.path.relpath(path, out_dir)
    except ValueError:  # another drive (Windows)
        rel = path
    return Path(rel).as_posix()


def _windows(windows: list[dict[str, Any]], out_dir: Path) -> str:
    if not windows:
        return ("<p class='note'>No profiler window (distdebug attach --profile-steps A:B, or one is taken "
                "automatically after an error finding).</p>")
    rows = []
    for w in windows:
        s = w["summary"]

        def pct(k: str, s: dict[str, Any] = s) -> str:
            return "-" if s.get(k) is None else f"{s[k]:.0%} ({s.get(k + '_min', 0):.0%}-{s.get(k + '_max', 0):.0%})"
        links = " ".join(
            (f"<a href='{_e(_href(t['path'], out_dir))}'>rank {t['rank']}</a>" if not t.get("error")
             else f"rank {t['rank']}: {_e(t['error'])}") for t in w["traces"][:64])
        more = f" and {len(w['traces']) - 64} more in {_e(w['dir'])}" if len(w["traces"]) > 64 else ""
        steps = f"{w['steps'][0]}-{w['steps'][1]}" if w.get("steps") else "?"
        rows.append(f"<tr><td>{steps}</td><td>{pct('overlap_ratio')}</td><td>{pct('comm_share')}</td>"
                    f"<td>{pct('data_share')}</td><td>{_e('; '.join(w['verdicts']) or 'healthy')}</td>"
                    f"<td>{links}{more}</td></tr>")
    return ("<table class='windows'><tr><th>steps</th><th>comm overlapped with compute</th><th>comm share</th>"
            "<th>data loader share</th><th>verdict</th><th>traces (open in ui.perfetto.dev or chrome://tracing)"
            "</th></tr>" + "".join(rows) + "</table>")


def _doctor_checks(run: Run) -> str:
    """The doctor's checks that did not pass, with the ranks they failed on (doctor runs only)."""
    doctor = read_json(layout.doctor_path(Path(run.path))) or {}
    ranks = doctor.get("ranks") or {}
    if not ranks:
        return ""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    passed = 0
    for rank, r in sorted(ranks.items(), key=lambda kv: str(kv[0])):
        for c in r.get("checks", []):
            if c.get("status") == "pass":
                passed += 1
                continue
            row = rows.setdefault((c.get("name", ""), c.get("status", ""), c.get("detail", "")),
                                  {"fix": c.get("fix", ""), "ranks": []})
            row["ranks"].append(str(rank))
    body = "".join(f"<tr><td>{_e(n)}</td><td><span class='sev {'error' if st == 'fail' else 'warning'}'>{_e(st)}"
                   f"</span></td><td>{_e(', '.join(v['ranks']))}</td><td>{_e(d)}</td><td>{_e(v['fix'])}</td></tr>"
                   for (n, st, d), v in rows.items())
    table = ("<table><tr><th>check</th><th>status</th><th>ranks</th><th>detail</th><th>fix</th></tr>" + body +
             "</table>") if rows else ""
    return (f"<section><h2>Doctor checks</h2>{table}<p class='note'>{passed} checks passed over "
            f"{len(ranks)} ranks.</p></section>")


def _harness_cost(summary: RunSummary) -> str:
    """The harness's own accounting per rank (analysis.cost) and the in-job A/B (analysis.overhead)."""
    cost = summary.harness_cost
    parts = []
    if summary.overhead:
        parts.append(f"<p>{_e(describe_overhead(summary.overhead))}</p>")
    if cost:
        ranks = cost["ranks"]
        owners = sorted({k for r in ranks.values() for k in r["per_step_ms"]},
                        key=lambda k: -max(r["per_step_ms"].get(k, 0.0) for r in ranks.values()))

        def row(rank: str, r: dict[str, Any]) -> str:
            share = "-" if r.get("fraction") is None else f"{r['fraction']:.1%}"
            cells = "".join(f"<td>{r['per_step_ms'].get(k, 0.0):.3f}</td>" for k in owners)
            return (f"<tr><td>{_e(rank)}</td><td>{r['total_per_step_ms']:.3f}</td><td>{share}</td>{cells}"
                    f"<td>{r['host_reads_per_step']:g}</td><td>{r.get('startup_ms', 0):.0f}</td></tr>")

        head = "".join(f"<th>{_e(k)}</th>" for k in owners)
        parts.append(f"<table class='cost'><tr><th>rank</th><th>steady ms per step</th><th>of the median step</th>"
                     f"{head}<th>host reads per step</th><th>start-up ms (once)</th></tr>"
                     + "".join(row(rank, r) for rank, r in ranks.items()) + "</table>"
                     + f"<p>rank {cost['rank']}: {_e(one_off_text(ranks[str(cost['rank'])]))}</p>")
        if cost.get("model"):
            parts.append(f"<p>{_e(describe_model(cost['model']))}</p>")
        if cost.get("advice"):
            parts.append(f"<p class='note'>{_e(cost['advice'])}</p>")
    if not parts:
        return ""
    return "<section><h2>Harness cost per step</h2>" + "".join(parts) + "</section>"


def render_html(run: Run, summary: RunSummary, out: Path) -> Path:
    """Write the report for ``run`` to ``out`` (a file); returns its path."""
    out = Path(out)
    findings = findings_with_advice(summary.findings, run_dir=summary.run_dir, incidents=summary.incidents)
    data = plot_data(run, summary, findings)
    bad = data["first_bad"]
    if bad:
        banner = (f"<div class='banner bad'>First bad step: {bad['step']} ({', '.join(bad['detectors'])} on "
                  f"rank(s) {_e(rank_list(bad['ranks']))}: <code>{_e(bad['subject'])}</code>)</div>")
    elif any(f["severity"] in ("error", "critical") for f in findings):
        banner = "<div class='banner bad'>Errors found (not tied to a step): see the findings.</div>"
    else:
        banner = "<div class='banner ok'>No error finding.</div>"
    for i in summary.injected:
        banner += (f"<div class='banner fault'>Fault injected on purpose: {_e(i.get('fault'))} on rank "
                   f"{_e(i.get('rank'))} at step {_e(i.get('step'))}</div>")
    for name in summary.never_acted:
        why = summary.why_not.get(name)  # the fault's own reasons; the generic line only when it gave none
        said = _e("; ".join(why)) if why else "nothing it acts through was there, or its step never came"
        banner += f"<div class='banner fault'>Fault injected on purpose: {_e(name)} never acted ({said})</div>"
    # A doctor run trains nothing: no empty training plots there; a training run without the doctor: no
    # empty bandwidth boxes.
    training = ("loss", "step_time", "memory", "straggler")
    wanted = [p for p in PLOTS if (p[0] not in ("sweep", "links") or data["doctor"])
              and (p[0] not in training or data["steps"]["last"] or not data["doctor"])]
    plots = "".join(f"<section><h2>{_e(t)}</h2><p class='note'>{_e(n)}</p><div class='plot' data-plot='{k}'></div>"
                    f"</section>" for k, t, n in wanted)
    exit_text = "-" if summary.exit_code is None else str(summary.exit_code)
    if summary.failure:
        exit_text += f" ({summary.failure})"
    payload = strictjson.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>distdebug report: {_e(Path(summary.run_dir).name)}</title>
<style>{_asset("report.css")}</style></head>
<body><header><h1>distdebug report</h1>
<div class="meta">{_e(summary.run_dir)}<br>{_merged(summary)}command: {_e(" ".join(summary.command or []))}<br>
world size {_e(summary.world_size or "?")} &middot; exit code {_e(exit_text)} &middot; {len(summary.findings)} findings
&middot; generated {datetime.datetime.now().isoformat(timespec="seconds")}</div></header>
<main>{banner}
{_incidents(summary)}
<section><h2>Findings ({len(findings)}), most severe first</h2>{_findings_table(findings)}</section>
<div class="grid">{plots}</div>
{_doctor_checks(run)}
<section><h2>Ranks</h2>{_ranks_table(summary)}</section>
{_harness_cost(summary)}
<section><h2>Profiler windows</h2>{_windows(data["windows"], out.parent.resolve())}</section>
{_cards(findings)}
</main>
<script type="application/json" id="distdebug-data">{payload}</script>
<script>{_asset("report.js")}</script>
</body></html>
"""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out

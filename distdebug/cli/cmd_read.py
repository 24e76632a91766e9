"""Reading a run: ``report``, ``top``, ``stacks``, ``diff``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from distdebug import strictjson
from distdebug.cli.base import SEVERITIES_HELP, gate, main, run_dirs
from distdebug.config import (
    EXIT_FINDINGS,
    FAIL_ON,
)
from distdebug.errors import UserError


@main.command(short_help="Incidents, findings with cause and fix, and per-rank progress of a run.")
@click.argument("runs", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--html", "html_out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write a self-contained HTML report with plots to this file.")
@click.option("--fail-on", "fail_on", type=click.Choice(FAIL_ON), default=None,
              help=f"Exit {EXIT_FINDINGS} when a finding of this severity or worse is there (distdebug's own "
                   "'harness' findings never count): a CI gate. " + SEVERITIES_HELP)
def report(runs: tuple[str, ...], as_json: bool, html_out: str | None, fail_on: str | None) -> int:
    """Incidents, findings (with likely cause and fix) and per-rank progress of RUN (default: the newest run
    under ./distdebug-runs); several RUNs: one job's nodes, each with its own run directory, merged into one
    run. --html FILE also writes a self-contained page with plots."""
    from distdebug.analysis.summary import summarize
    from distdebug.artifacts.reader import load_runs

    loaded = load_runs(run_dirs(runs))
    summary = summarize(loaded)
    for warning in summary.warnings:  # damage is said, never silently skipped; stdout stays the report
        print(f"distdebug: warning: {warning}", file=sys.stderr)
    if as_json:
        from distdebug.report.console import render_json

        click.echo(render_json(summary))
    else:
        from distdebug.report.console import render

        render(summary)
    if html_out:
        from distdebug.report.html import render_html

        try:
            path = render_html(loaded, summary, Path(html_out))
        except OSError as e:
            raise UserError(f"--html {html_out}: cannot write it ({e.strerror or e}); choose a writable path") from None
        print(f"distdebug: HTML report {path}", file=sys.stderr)
    return gate(summary.findings, fail_on)



@main.command(short_help="Each rank of a running job, live: step, speed, loss, findings, status.")
@click.argument("runs", nargs=-1)
@click.option("--once", is_flag=True, help="Print the ranks' state once and exit (also when stdout is not a "
              "terminal).")
@click.option("--json", "as_json", is_flag=True, help="The ranks' state once, machine-readable.")
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds between refreshes.")
def top(runs: tuple[str, ...], once: bool, as_json: bool, interval: float) -> int:
    """Each rank of RUN (default: the newest run; several: one job's nodes) as it is now: step, steps/s, last
    loss, step time, findings, status; refreshed until every rank has ended. A finished run: its final state."""

    from distdebug.analysis.live import Follower, running, snapshot_rows

    if not interval > 0:
        raise UserError(f"--interval must be a positive number of seconds, got {interval:g}")
    dirs = run_dirs(runs)
    follower = Follower(dirs)
    ranks = follower.poll()
    if as_json:
        click.echo(strictjson.dumps({"run_dirs": [str(d) for d in dirs], "running": running(ranks, dirs),
                               "ranks": snapshot_rows(ranks)}))
        return 0
    from distdebug.report.live_view import show

    show(follower, dirs, live=not once and sys.stdout.isatty(), interval=interval)
    return 0


@main.command(short_help="Every rank's Python stack now, grouped: which rank waits where.")
@click.argument("run", required=False)
@click.option("--timeout", type=float, default=5.0, show_default=True,
              help="Seconds to wait for every rank's answer.")
@click.option("--native/--no-native", default=True, show_default=True,
              help="Native frames too, through py-spy where it is installed.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output: the groups and every answer.")
def stacks(run: str | None, timeout: float, native: bool, as_json: bool) -> int:
    """Every rank's Python stack of the running job RUN (default: the newest run), now, grouped by
    identical stacks: which rank waits where. The job goes on."""

    from distdebug.analysis import stacks as stacks_mod
    from distdebug.artifacts.runs import resolve_run

    if not timeout > 0:
        raise UserError(f"--timeout must be a positive number of seconds, got {timeout:g}")
    answers, missing = stacks_mod.request(resolve_run(run), timeout)
    groups = stacks_mod.group(answers)
    dumps, note = stacks_mod.native_dumps(answers) if native and answers else ({}, None)
    if as_json:
        click.echo(strictjson.dumps({
            "headline": stacks_mod.headline(groups),
            "groups": [{"ranks": g.ranks, "summary": g.summary, "frames": g.frames} for g in groups],
            "missing": {str(r): why for r, why in missing.items()},
            "answers": {str(r): a.answer for r, a in sorted(answers.items())},
            "native": {str(r): text for r, text in dumps.items()}, "native_note": note,
        }, default=str))
    else:
        from distdebug.report.stacks_view import render

        click.echo(render(groups, missing, dumps, note))
    return 1 if missing else 0


@main.command(short_help="Which ranks' (or two runs') tensors differ, and from which step.")
@click.argument("run", required=False)
@click.argument("other", required=False)
@click.option("--step", type=int, default=None, help="Compare the ranks at this step (default: find the first "
              "divergent step).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--node", "nodes", multiple=True, metavar="DIR",
              help="Another node's run directory of the same job (nodes without a shared file system each write "
                   "their own): its ranks are compared too. Repeatable.")
def diff(run: str | None, other: str | None, step: int | None, as_json: bool, nodes: tuple[str, ...]) -> int:
    """Cross-rank fingerprint diff of RUN (default: newest), or run-against-run with OTHER.

    \b
    distdebug diff RUN --step N     tensors that differ across ranks at step N
    distdebug diff RUN              the first step where replicas diverge
    distdebug diff RUN_A RUN_B      the first step and tensor where two runs differ
    distdebug diff RUN --node DIR   RUN with another node's run directory of the same job
    Exit code 1 when something differs, 0 when identical.
    """
    from distdebug.analysis import diff as diff_mod
    from distdebug.artifacts.runs import resolve_run
    from distdebug.report import diffview

    if other is not None:
        if step is not None or nodes:
            raise click.UsageError("--step and --node apply to one run; give RUN alone, or RUN_A RUN_B without them")
        result = diff_mod.runs_result(resolve_run(run), resolve_run(other))
    else:
        result = diff_mod.rank_result(resolve_run(run), step, [resolve_run(n) for n in nodes])
    if as_json:

        click.echo(strictjson.dumps(result, indent=2))
    else:
        diffview.render(result)
    return 0 if result["identical"] else 1

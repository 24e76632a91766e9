"""``distdebug faults``: the catalogue, and its replay on a script or the recipes."""

from __future__ import annotations

from pathlib import Path

import click

from distdebug.cli.base import HelpfulGroup, main
from distdebug.errors import UserError


@main.group(cls=HelpfulGroup, short_help="Inject faults on purpose and prove each detector catches its own.")
def faults() -> None:
    """Inject faults on purpose and prove that each detector catches its fault (fault x engine matrix)."""


@faults.command("list", short_help="The fault catalogue: what each fault does and what must catch it.")
def faults_list() -> int:
    """The fault catalogue: what each fault does, its parameters, the detector that must catch it."""
    from rich.console import Console

    from distdebug.fault_injection.console import catalogue

    out = Console()
    catalogue(out if out.is_terminal else Console(width=160))
    return 0


@faults.command("replay", short_help="Replay each fault and a clean twin on a script; check the findings.",
                context_settings={"allow_interspersed_args": False})
@click.option("--fault", "fault_names", multiple=True,
              help="Only this fault (repeatable). Default: every fault (on SCRIPT, every fault one run can show: "
                   "the parity faults, judged against a 1-rank reference, run when named).")
@click.option("--skip", "skip_names", multiple=True, help="Not this fault (repeatable).")
@click.option("--inject", "overrides", multiple=True, metavar="SPEC",
              help="Set a fault's parameters on SCRIPT instead of the fitted ones, e.g. nan_grad:param=head.weight,"
                   "step=5 (repeatable; see: distdebug faults list).")
@click.option("--recipe", "engines", multiple=True,
              help="Only this recipe (repeatable): ddp, manual, fsdp2, zero2, zero2_resume, doctor, the layouts "
                   "tp, ddp_tp, hsdp_tp, pp, pp_dp, and parity, whose faults distdebug parity judges. Default: "
                   "each fault's own.")
@click.option("--nproc", type=int, default=2, show_default=True, help="Ranks per run.")
@click.option("-j", "--jobs", type=int, default=1, show_default=True,
              help="Runs side by side (each on its own rendezvous port); at most cores / ranks per run is fair.")
@click.option("--cell-timeout", type=float, default=300.0, show_default=True,
              help="Seconds one run may take before it is stopped (an error cell).")
@click.option("--keep-runs", is_flag=True, help="Keep every run directory (default: only the failed cells').")
@click.option("--junit", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a JUnit XML report here (not-applicable faults are skipped test cases).")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the replay runs go. Default: a new directory ./distdebug-runs/<time>-faults.")
@click.argument("script", nargs=-1, type=click.UNPROCESSED)
def faults_replay(fault_names: tuple[str, ...], skip_names: tuple[str, ...], overrides: tuple[str, ...],
                  engines: tuple[str, ...], nproc: int, jobs: int, cell_timeout: float, keep_runs: bool,
                  junit: Path | None, work_dir: Path | None, script: tuple[str, ...]) -> int:
    """Run each fault, and a clean run, under attach on SCRIPT [ARGS] (or the project's recipes) and
    check that the expected findings appear with the right rank, step and subject.

    \b
    On SCRIPT the clean run comes first and shows what the script has: only the faults that can act on
    it run (fitted to its number of steps and its model), the others are reported not applicable with
    the reason. Exits 0 when every applicable fault is caught and localised and the clean run has no
    finding, 1 otherwise (the failed cells named).
    """
    import os

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from distdebug.artifacts.runs import new_run_dir
    from distdebug.fault_injection.base import parse_spec
    from distdebug.fault_injection.console import isolation, matrix, summary
    from distdebug.fault_injection.matrix import ENGINES, junit_xml, plan, replay, replay_script
    from distdebug.fault_injection.registry import FAULTS

    for f in (*fault_names, *skip_names):
        if f not in FAULTS:
            raise UserError(f"unknown fault '{f}'; known: {', '.join(FAULTS)} (see: distdebug faults list)", 2)
    for e in engines:
        if e not in ENGINES:
            raise UserError(f"unknown recipe '{e}'; known: {', '.join(ENGINES)}", 2)
    if script and engines:
        raise UserError("give either --recipe or a SCRIPT, not both", 2)
    if script and not Path(script[0]).is_file():
        raise UserError(f"script not found: {script[0]}", 2)
    if overrides and not script:
        raise UserError("--inject sets a fault's parameters on your SCRIPT; the recipes' are fixed (give a SCRIPT)", 2)
    if nproc < 1:
        raise UserError(f"--nproc must be 1 or more, got {nproc}", 2)
    if jobs < 1:
        raise UserError(f"-j/--jobs must be 1 or more, got {jobs}", 2)
    if cell_timeout <= 0:
        raise UserError(f"--cell-timeout must be positive seconds, got {cell_timeout:g}", 2)
    fitted: dict[str, dict[str, object]] = {}
    for spec in overrides:
        cls, params = parse_spec(spec, FAULTS)
        fitted.setdefault(cls.name, {}).update(params)
    # on a script, the parity faults (judged by distdebug parity, against a reference) only when named
    default = [f for f, cls in FAULTS.items() if not script or not all(ENGINES[e].parity for e in cls.engines)]
    chosen = [f for f in (fault_names or default) if f not in skip_names]
    chosen += [f for f in fitted if f not in chosen and f not in skip_names]  # a fault given parameters runs
    if not chosen:
        raise UserError("nothing to replay: --skip leaves no fault (see: distdebug faults list)", 2)
    cells = plan(chosen, list(engines) or None) if not script else []
    if not script and not cells:
        raise UserError("nothing to replay: none of the chosen faults runs on the chosen recipes "
                        "(see: distdebug faults list)", 2)
    console = Console(stderr=True)
    if jobs > 1 and jobs * nproc > (os.cpu_count() or 1):
        console.print(f"distdebug: note: -j {jobs} runs {jobs * nproc} ranks on {os.cpu_count()} cores: timing "
                      "faults (straggler, slow_dataloader) may be judged on a crowded machine")
    work = work_dir or new_run_dir("faults")  # its own, even beside another replay started this second
    work.mkdir(parents=True, exist_ok=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("left"), TimeRemainingColumn(), console=console, transient=True) as progress:
        task = progress.add_task("clean run (probing the script)" if script else "replaying faults",
                                 total=1 if script else len(cells))

        def done(cell):  # type: ignore[no-untyped-def]
            progress.update(task, advance=1, description=f"{cell.fault}: {cell.status}")

        def planned(runs: int) -> None:
            progress.update(task, total=1 + runs)

        isolated: list = []  # what the script's runs were isolated from (fault_injection.sandbox)
        if script:
            results = replay_script(list(script), chosen, work, nproc=nproc, overrides=fitted, jobs=jobs,
                                    timeout=cell_timeout, keep=keep_runs, on_cell=done, on_plan=planned,
                                    on_isolation=isolated.append)
        else:
            results = replay(cells, work, nproc=nproc, on_cell=done, jobs=jobs, timeout=cell_timeout,
                             keep=keep_runs)
    out = Console()
    shown = out if out.is_terminal else Console(width=160)
    for iso in isolated:
        lines, warnings = isolation(iso)
        for line in lines:  # a path is no markup, and is not broken across lines
            shown.print(line, markup=False, highlight=False, soft_wrap=True)
        for warning in warnings:
            click.echo(f"distdebug: {warning}", err=True)
    matrix(shown, results)
    if junit is not None:
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.write_text(junit_xml(results))
    kept = [c for c in results if c.run_dir]
    if kept:
        click.echo(f"runs kept in {work}" + ("" if keep_runs else " (the failed cells')"))
    else:
        try:
            work.rmdir()  # empty: every cell passed and nothing was asked to be kept
        except OSError:
            pass
        click.echo("every cell passed; no run kept (--keep-runs keeps them)")
    if not all(c.ok for c in results):  # on stderr too, one line each, unwrapped: what a CI log shows
        for c in results:
            if not c.ok:
                click.echo(f"distdebug: {c.fault}/{c.engine}: {c.status}: {c.reason}", err=True)
        click.echo("distdebug: " + summary(results), err=True)
    return 0 if all(c.ok for c in results) else 1

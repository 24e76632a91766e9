"""``distdebug parity``: does a run compute what a reference run computes."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from distdebug import strictjson
from distdebug.cli.base import main
from distdebug.errors import UserError


@main.command(short_help="Does a run compute what a reference run computes? The first step and tensor that departs.")
@click.argument("ref", required=False)
@click.argument("cand", required=False)
@click.option("--twin", default=None, metavar="RUN",
              help="The reference run again with 'attach --parity twin': its distance from the reference is the band "
                   "of benign rounding each quantity is judged against.")
@click.option("--launch-ref", "launch_ref", default=None, metavar="'ATTACH ARGS'",
              help="Make the runs first: the reference's attach arguments, quoted (e.g. '--nproc-per-node 1 train.py "
                   "--batch 32'); it runs twice, as the reference and as its twin.")
@click.option("--launch-cand", "launch_cand", default=None, metavar="'ATTACH ARGS'",
              help="With --launch-ref: the candidate's attach arguments, quoted (e.g. '--nproc-per-node 4 train.py').")
@click.option("--work-dir", "work_dir", type=click.Path(path_type=Path), default=None,
              help="With --launch-ref: where the three runs go (ref, twin, cand). Default: a new folder under "
                   "./distdebug-runs.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--html", "html_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write a self-contained page: the verdict and causes, both losses, the loss's distance "
                   "against its bound.")
def parity(ref: str | None, cand: str | None, twin: str | None, launch_ref: str | None, launch_cand: str | None,
           work_dir: Path | None, as_json: bool, html_out: Path | None) -> int:
    """Compare CAND with REF step by step, each recorded quantity against a band computed from REF's twin.

    \b
    distdebug attach --parity record --nproc-per-node 1 train.py ...   the reference (REF)
    distdebug attach --parity twin --nproc-per-node 1 train.py ...     its twin (TWIN)
    distdebug attach --parity record --nproc-per-node 4 train.py ...   the candidate (CAND)
    distdebug parity REF CAND --twin TWIN
    or, the three runs made first:
    distdebug parity --launch-ref '--nproc-per-node 1 train.py' --launch-cand '--nproc-per-node 4 train.py'
    Exit code 0: equivalent; 1: departs; 2: cannot compare (says why).
    """
    if html_out is not None:  # said before any run is made or read, not after
        import os

        parent = html_out.parent if str(html_out.parent) else Path(".")
        if html_out.is_dir() or (parent.is_dir() and not os.access(parent, os.W_OK)):
            raise UserError(f"--html {html_out}: cannot write a file there; choose a writable path", 2)
    if launch_ref is not None or launch_cand is not None:
        if launch_ref is None or launch_cand is None or ref or cand or twin:
            raise UserError("parity: give --launch-ref and --launch-cand together (the runs are made), or REF CAND "
                            "--twin TWIN (runs made by attach --parity), not both", 2)
        ref, twin, cand = _launch_parity_runs(launch_ref, launch_cand, work_dir)
    elif not (ref and cand and twin):
        raise UserError("parity: give REF CAND --twin TWIN (runs made by attach --parity), or --launch-ref and "
                        "--launch-cand to make them", 2)
    from distdebug.analysis import parity as parity_mod
    from distdebug.artifacts.reader import load_run
    from distdebug.artifacts.runs import resolve_run

    try:
        loaded = [load_run(resolve_run(r)) for r in (ref, twin, cand)]
        a, b, c = (parity_mod.recorded(run) for run in loaded)
        result = parity_mod.compare_runs(a, b, c)
        result.sizes = parity_mod.side_by_side(parity_mod.size_of(loaded[0]), parity_mod.size_of(loaded[2]))
    except parity_mod.CannotCompare as e:
        raise UserError(f"parity: cannot compare: {e}", 2) from None
    except UserError as e:  # a path that is no run: cannot compare (2), not "departs" (1)
        raise UserError(str(e), 2) from None
    v = result.verdict
    if html_out is not None:
        from distdebug.report.parity_html import render_parity_html

        try:
            path = render_parity_html(result, html_out, ref=str(ref), cand=str(cand), twin=str(twin))
        except OSError as e:
            raise UserError(f"--html {html_out}: cannot write it ({e.strerror or e}); choose a writable path",
                            2) from None
        print(f"distdebug: parity page {path}", file=sys.stderr)
    if as_json:
        def dep(d: parity_mod.Departure | None) -> dict[str, object] | None:
            return None if d is None else {"quantity": d.quantity, "step": d.step, "observed": d.observed,
                                           "bound": d.bound, "ratio": d.ratio}

        click.echo(strictjson.dumps({  # a ratio or observation that is not finite: "Infinity", "NaN"
            "equivalent": v.equivalent, "steps": result.steps, "ref_world": result.ref_world,
            "cand_world": result.cand_world, "cause": result.cause,
            "causes": [{"kind": c.kind, "step": c.step, "text": c.text} for c in result.causes],
            "first": dep(v.first), "largest": dep(v.largest), "loss_departs": v.loss_departs,
            "compared": v.compared, "missing": v.missing, "upto": result.upto, "sizes": result.sizes,
            "text": result.text()}, indent=2))
    else:
        click.echo(result.text())
    return 0 if v.equivalent else 1


PARITY_PROFILE = "4:5"
"""The steps the runs parity makes profile (the reference's and the candidate's, not the twin's): their
communication share, beside the step time (a run shorter than that has none)."""


def _launch_parity_runs(launch_ref: str, launch_cand: str, work_dir: Path | None) -> tuple[str, str, str]:
    """The three runs parity compares, made with attach (a process each, as a user would): the reference, its
    twin (the same arguments) and the candidate, under ``work_dir``; the reference and the candidate profile steps
    PARITY_PROFILE unless their arguments choose other steps. A run that fails: cannot compare (2)."""
    import shlex
    import subprocess

    from distdebug.artifacts.runs import new_run_dir

    work = work_dir if work_dir is not None else new_run_dir("parity")
    made = []
    for name, mode, args in (("ref", "record", launch_ref), ("twin", "twin", launch_ref),
                             ("cand", "record", launch_cand)):
        run_dir = work / name
        words = shlex.split(args)
        script_at = next((i for i, w in enumerate(words) if w.endswith(".py") or w == "-m"), len(words))
        if name != "twin" and "--profile-steps" not in words[:script_at]:  # attach's own, before the script
            args = f"--profile-steps {PARITY_PROFILE} {args}"  # the communication share beside the step time
        print(f"distdebug parity: the {'reference' if name == 'ref' else name}: distdebug attach --parity {mode} "
              f"--run-dir {run_dir} {args}", file=sys.stderr, flush=True)
        # the runs' own output on stderr: stdout is the verdict's (--json)
        code = subprocess.call([sys.executable, "-m", "distdebug", "attach", "--parity", mode, "--run-dir",
                                str(run_dir), *shlex.split(args)], stdout=2)
        if code != 0:
            raise UserError(f"parity: cannot compare: the {name} run exited {code} (see: distdebug report "
                            f"{run_dir})", 2)
        made.append(str(run_dir))
    return made[0], made[1], made[2]

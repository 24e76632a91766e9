"""The ``distdebug`` command: a thin click layer over the library.

Imports here stay light (no torch): ``distdebug --help`` must answer in well under half a second.
Every error reaches the user as one line and a non-zero exit; set DISTDEBUG_DEBUG=1 to see
distdebug's own traceback for an internal error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from distdebug import envvars, strictjson
from distdebug.artifacts.retention import parse_size, size_text
from distdebug.config import (
    EXIT_FINDINGS,
    EXPECTED_HOURS,
    FAIL_ON,
    ON_HANG,
    ON_STALL,
    OVERHEAD_AUTO,
    RUN_DIR_BUDGET,
    STARTUP_FLOOR_S,
    WATCH_MODES,
    AttachConfig,
    LossSpikeConfig,
    NanOriginConfig,
    ProfilerConfig,
    ReplicaDivergenceConfig,
    option_default,
)
from distdebug.errors import UserError
from distdebug.findings import SEVERITY_MEANING

SEVERITIES_HELP = "Severities, least to most severe: " + "; ".join(
    f"{name}, {text.split(':')[0]}" for name, text in SEVERITY_MEANING.items()) + " (the docs' Findings page)."


class _Size(click.ParamType):
    """A size in bytes: 512K, 64M, 1G (binary units), a plain number of bytes, or 0."""

    name = "SIZE"

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        if isinstance(value, int):
            return value
        if str(value).strip() in ("0", "none", "off"):
            return 0
        try:
            return parse_size(str(value))
        except (ValueError, IndexError):
            self.fail(f"'{value}' is not a size: give e.g. 512K, 64M or 1G (0: no budget)", param, ctx)


_SIZE = _Size()


class HelpfulGroup(click.Group):
    """A group that, called bare, prints its help and exits 0 (a question, not an error), and lists its
    commands with their whole first sentence (click cuts them at 45 characters with "...")."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args and not ctx.resilient_parsing:  # not under shell completion, which parses with no args
            click.echo(ctx.get_help())
            ctx.exit(0)
        return super().parse_args(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, cmd.get_short_help_str(limit=10_000)) for name in self.list_commands(ctx)
                if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class OneLineErrors(HelpfulGroup):
    """Usage and user errors as one line: what is wrong and what to do; never a traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        try:
            rv = super().main(args=args, prog_name=prog_name or "distdebug", complete_var=complete_var,
                              standalone_mode=False, **extra)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            print("distdebug: aborted", file=sys.stderr)
            sys.exit(130)
        except click.UsageError as e:
            path = e.ctx.command_path if e.ctx else "distdebug"
            print(f"distdebug: error: {e.format_message().rstrip('.')}; see '{path} --help'", file=sys.stderr)
            sys.exit(2)
        except click.ClickException as e:
            print(f"distdebug: error: {e.format_message()}", file=sys.stderr)
            sys.exit(e.exit_code)
        except UserError as e:
            print(f"distdebug: error: {e}", file=sys.stderr)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            sys.exit(130)
        except Exception as e:
            if envvars.get(envvars.DEBUG):
                raise
            print(f"distdebug: internal error: {type(e).__name__}: {e} "
                  "(distdebug's own bug: rerun with DISTDEBUG_DEBUG=1 for the traceback and report it; what to "
                  "send: the docs' Contributing page, Reporting a problem)", file=sys.stderr)
            sys.exit(70)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="distdebug", message="distdebug %(version)s")
def main() -> None:
    """distdebug: which rank, which step, which tensor broke your distributed training, and what to do."""


def _refuse(ctx: click.Context, param: click.Parameter, value: object) -> None:
    if value:
        raise UserError(f"{param.opts[0]}: {param.help}", 2)


def _torchrun_options(f):  # type: ignore[no-untyped-def]
    """torchrun's options that attach does not handle itself (launch.torchrun_options): passed to torch's
    launcher as typed, accepted as what attach does anyway, or refused in one line (hidden from --help)."""
    from distdebug.launch.torchrun_options import OPTIONS, PASS, REFUSE

    for opt in reversed(OPTIONS):  # click lists options in the order they are declared
        kind = click.Choice(opt.choices) if opt.choices else click.types.convert_type(opt.type)
        f = click.option(
            *opt.names, opt.param, envvar=opt.envvar, help=opt.help, hidden=opt.use == REFUSE,
            expose_value=opt.use == PASS, callback=_refuse if opt.use == REFUSE else None,
            **({"is_flag": True, "default": False} if opt.flag else {"type": kind, "default": None}),
        )(f)
    return f


@main.command(short_help="Run SCRIPT on every rank under torch's launcher, instrumented; no code changes.",
              context_settings={"allow_interspersed_args": False, "ignore_unknown_options": False})
@click.option("--nproc-per-node", "--nproc_per_node", "nproc_per_node", default=None, envvar="PET_NPROC_PER_NODE",
              help="Ranks on this node: a number, or gpu/cpu/auto/xpu. Default: one per GPU, else 2 -- not "
                   "torchrun's 1: the cross-rank checks need two ranks; give 1 for one rank.")
@click.option("--nnodes", default="1", show_default=True, envvar="PET_NNODES",
              help="Nodes: N or MIN:MAX (elastic).")
@click.option("--node-rank", "--node_rank", "node_rank", type=int, default=0, show_default=True,
              envvar="PET_NODE_RANK", help="This node's rank (static rendezvous).")
@click.option("--rdzv-backend", "--rdzv_backend", "rdzv_backend", default="static", show_default=True,
              envvar="PET_RDZV_BACKEND", help="Rendezvous backend: static or c10d.")
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint", default="", envvar="PET_RDZV_ENDPOINT",
              help="Rendezvous HOST:PORT.")
@click.option("--rdzv-id", "--rdzv_id", "rdzv_id", default="none", show_default=True, envvar="PET_RDZV_ID",
              help="Rendezvous job id.")
@click.option("--rdzv-conf", "--rdzv_conf", "rdzv_conf", default="", envvar="PET_RDZV_CONF",
              help="Rendezvous options key=value,... (e.g. join_timeout=60).")
@click.option("--standalone", is_flag=True, envvar="PET_STANDALONE",
              help="Single node with a local rendezvous on a free port.")
@click.option("--max-restarts", "--max_restarts", "max_restarts", type=int, default=0, show_default=True,
              envvar="PET_MAX_RESTARTS", help="Restarts of the worker group before failing.")
@click.option("--master-addr", "--master_addr", "master_addr", default=None, envvar="PET_MASTER_ADDR",
              help="Static rendezvous address.")
@click.option("--master-port", "--master_port", "master_port", type=int, default=None, envvar="PET_MASTER_PORT",
              help="Static rendezvous port.")
@click.option("-m", "--module", is_flag=True, envvar="PET_MODULE", help="SCRIPT is a module name, run like python -m.")
@_torchrun_options
@click.option("--run-dir", type=click.Path(path_type=Path), default=None,
              help="Where this run's records go. Default: a new directory under ./distdebug-runs/.")
@click.option("--stall-timeout", type=float, default=option_default(AttachConfig, "stall_timeout"), show_default=True,
              help="Seconds without progress (no step, no collective finished) before a rank counts as stalled; "
                   "then every rank's stacks and Flight Recorder trace are collected and the hang is diagnosed. "
                   "0: off.")
@click.option("--startup-timeout", type=float, default=None,
              show_default=f"max(--stall-timeout, {STARTUP_FLOOR_S:g})",
              help="Seconds without progress allowed to a rank that has not finished its first step (imports, "
                   "model building, init_process_group, the first collectives, torch.compile) and to the "
                   "rendezvous: ranks start unevenly, and a slow start is not a hang.")
@click.option("--run-dir-budget", type=_SIZE, default=size_text(RUN_DIR_BUDGET), show_default=True,
              help="Disk each rank may fill in the run directory, however long the job (e.g. 64M, 1G; 0: no "
                   "budget). Past it the oldest steps are thinned to summaries; the first and last steps and "
                   "every finding's neighbourhood stay whole.")
@click.option("--expected-hours", type=float, default=None,
              show_default=f"Slurm's end time, else {EXPECTED_HOURS:g}",
              help="How long the job is expected to run: attach warns when a file system it writes to (the run "
                   "directory, the output file, NCCL's or torchrun's logs) would fill before then, at the rate "
                   "measured over its first minute of steps.")
@click.option("--on-hang", type=click.Choice(ON_HANG), default=option_default(AttachConfig, "on_hang"),
              show_default=True,
              help="After a hang verdict: end the job (exit code 124), or only report and keep waiting.")
@click.option("--on-stall", type=click.Choice(ON_STALL), default=option_default(AttachConfig, "on_stall"),
              show_default=True,
              help="A stall with no culprit (every rank busy in its own work: a long evaluation, a save): warn with "
                   "every rank's stack and go on, or end the job as a hang.")
@click.option("--fingerprint-every", type=int, default=None,
              show_default=str(option_default(ReplicaDivergenceConfig, "every")),
              help="Cross-rank fingerprint check of replicated tensors every K optimizer steps "
                   "(replica_divergence.every).")
@click.option("--measure-overhead", "measure_overhead", is_flag=True, default=False,
              help="Measure what the harness costs this job: the detectors are switched off and on inside the job, "
                   "in pairs of steps (one with, one without, the order drawn per pair; the same steps on every "
                   "rank), and the report compares their wall and CPU times with a 95% interval.")
@click.option("--overhead-block", type=int, default=None, show_default="1 step; 8 where CUDA is available",
              help="Steps per unit with --measure-overhead (each pair is a unit on and a unit off): 1 is the most "
                   "precise; more where work lands a step late (a GPU's queue: a step that reads nothing from the "
                   "device leaves its work to the next).")
@click.option("--replica-groups", default=None, metavar="R,R;R,R",
              help="The data-parallel groups (ranks holding replicas of the same part of the model), e.g. 0,2;1,3, "
                   "for a layout distdebug cannot infer; every cross-rank check compares within them.")
@click.option("--stop-on-nan", is_flag=True, default=None,
              help="End the job at the first NaN/Inf (exit code 123) after reporting where it started "
                   "(nan_origin.stop). Default: report and keep going.")
@click.option("--nan-watch", "nan_watch", type=click.Choice(WATCH_MODES), default=None,
              show_default=str(option_default(NanOriginConfig, "watch")),
              help="How the module a NaN/Inf started in is found: on-demand re-executes the step found non-finite "
                   "with every module watched (holds a copy of the parameters); full checks every module's output "
                   "in every step (nan_origin.watch).")
@click.option("--rerun-on-anomaly", "rerun_on_anomaly", is_flag=True, default=False,
              help="Capture each step (inputs, generator states, parameters before it) so that a rank flagged at a "
                   "step (a NaN born there, its loss spiking) re-executes it: reproducible (a code path or the "
                   "data) or not (a transient fault: suspect the machine). Costs a copy of the model a step.")
@click.option("--parity", "parity", type=click.Choice(["record", "twin"]), default=None,
              help="Record what 'distdebug parity' compares between two runs (each parameter's and gradient's "
                   "sketch and norm, the loss, at steps 1-8 and each power of two); twin: also flip the last bit "
                   "of a random half of every parameter after each step: the reference's twin, whose distance "
                   "from the reference is the band of benign rounding (its results differ on purpose).")
@click.option("--parity-steps", "parity_steps", default=None, metavar="STEPS",
              help="With --parity: the steps whose tensors are recorded (ranges, steps and pow2, comma-separated; "
                   "default 1-8,pow2). The loss and the gradients' norm are recorded at every step.")
@click.option("--deterministic", is_flag=True, default=False,
              help="Seed Python's, numpy's and torch's generators with 0 and turn on torch's deterministic "
                   "algorithms before the script runs.")
@click.option("--spike-threshold", type=float, default=None,
              show_default=str(option_default(LossSpikeConfig, "threshold")),
              help="Loss / gradient-norm spike: robust z (median and MAD of the window) above which a value counts "
                   "(loss_spike.threshold).")
@click.option("--spike-window", type=int, default=None, show_default=str(option_default(LossSpikeConfig, "window")),
              help="Steps of history a spike is measured against (loss_spike.window).")
@click.option("--profile-steps", default=None, metavar="A:B[,C:D]",
              help="Trace these optimizer steps with torch.profiler on every rank (gzip Chrome traces in the run "
                   "directory, for Perfetto and Holistic Trace Analysis), e.g. 4995:5005 (profiler.steps).")
@click.option("--profile-on-finding", type=int, default=None,
              show_default=str(option_default(ProfilerConfig, "on_finding")),
              help="Steps traced on every rank after a spike, NaN or straggler finding (once per run); 0: off "
                   "(profiler.on_finding).")
@click.option("--detector-option", "detector_option", multiple=True, metavar="DETECTOR.KEY=VALUE",
              help="Set one option of a detector, yours included (by its name, its spec or its class name), "
                   "e.g. loss_spike.window=100 (repeatable; see: distdebug detectors).")
@click.option("--launcher-log-level", default="CRITICAL", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False),
              help="Log level of torch's elastic launcher (its messages repeat distdebug's by default).")
@click.option("--detectors", default=None,
              help="Comma-separated detectors (names, file.py:Class or module:Class). Default: all default ones; "
                   "'-name,...' leaves those out of the default set (e.g. --detectors=-nan_origin).")
@click.option("--fail-on", "fail_on", type=click.Choice(FAIL_ON), default=None,
              help=f"When the training exits 0, exit {EXIT_FINDINGS} if the report of this node's run directory "
                   "has a finding of this severity or worse (each rank's last attempt, and the run-level verdicts; "
                   "distdebug's own 'harness' findings never count): a CI gate. A failing training's exit code "
                   "always wins. " + SEVERITIES_HELP)
@click.option("--inject", "inject", multiple=True, metavar="FAULT[:KEY=VALUE,...]",
              help="Inject a fault on purpose, e.g. nan_grad:rank=1,step=5 (repeatable; see: distdebug faults list).")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def attach(script: str, script_args: tuple[str, ...], detectors: str | None, run_dir: Path | None,
           module: bool, inject: tuple[str, ...], detector_option: tuple[str, ...], fail_on: str | None,
           **launcher: object) -> int:
    """Run SCRIPT on every rank under torch's elastic launcher, instrumented; no code changes.

    Every torchrun option is accepted with torchrun's meaning (and its PET_* variable), but for
    --no-python (refused: SCRIPT must run in Python to be instrumented) and the --nproc-per-node
    default. Everything after SCRIPT goes to the script. The exit code is the training's exit code.
    """
    from distdebug import envvars
    from distdebug.config import SHORTHANDS
    from distdebug.launch import torchrun_options as passed
    from distdebug.launch.attach import attach as run_attach

    torchrun_args = passed.argv({k[len(passed.PREFIX):]: launcher.pop(k) for k in list(launcher)
                                 if k.startswith(passed.PREFIX)})
    block, measure = launcher.pop("overhead_block"), launcher.pop("measure_overhead")
    assert block is None or isinstance(block, int)  # click typed it
    if measure and block is not None and block < 1:
        raise UserError(f"--overhead-block {block}: give 1 step or more per unit", 2)
    launcher["measure_overhead"] = (OVERHEAD_AUTO if block is None else block) if measure else 0
    if launcher.get("parity_steps") is not None:
        from distdebug.config import chosen_steps

        if launcher.get("parity") is None:
            raise UserError("--parity-steps chooses the steps of --parity's records: give --parity record or twin", 2)
        chosen_steps(str(launcher["parity_steps"]))
    options: dict[str, dict[str, object]] = {}
    for name, (det, key) in SHORTHANDS.items():
        value = launcher.pop(name)
        if value is not None:
            options.setdefault(det, {})[key] = value
    cfg = AttachConfig(
        target=script, target_args=list(script_args), module=module, run_dir=run_dir,
        detectors=envvars.decode_list(detectors) if detectors is not None else None,
        inject=_resolve_faults(inject), shorthand_options=options,
        detector_options=_detector_options(detector_option), torchrun_args=torchrun_args,
        **launcher,  # type: ignore[arg-type]
    )
    result = run_attach(cfg, argv=["distdebug", *sys.argv[1:]])
    if result.message:
        what = "" if result.completed else "training failed: "
        print(f"distdebug: {what}{result.message}", file=sys.stderr)
    print(f"distdebug: run directory {result.run_dir} (see: distdebug report {result.run_dir})", file=sys.stderr)
    if fail_on and result.exit_code == 0:
        from distdebug.analysis.summary import summarize
        from distdebug.artifacts.reader import load_run

        try:
            findings = summarize(load_run(result.run_dir)).findings
        except Exception as e:  # noqa: BLE001 (a run directory it cannot read: said, the training's 0 stands)
            print(f"distdebug: --fail-on {fail_on}: could not read {result.run_dir} ({type(e).__name__}: {e}); "
                  "the training's exit code stands", file=sys.stderr)
            return result.exit_code
        return _gate(findings, fail_on)
    return result.exit_code


def _detector_options(items: tuple[str, ...]) -> dict[str, dict[str, object]]:
    """``DETECTOR.KEY=VALUE`` items -> {detector: {key: "value"}} (typed later, by the detector's config)."""
    out: dict[str, dict[str, object]] = {}
    for item in items:
        lhs, eq, value = item.partition("=")
        det, dot, key = lhs.rpartition(".")
        if not (eq and dot and det and key):
            raise UserError(f"--detector-option {item}: give DETECTOR.KEY=VALUE, e.g. loss_spike.window=100", 2)
        out.setdefault(det, {})[key] = value
    return out


def _resolve_faults(specs: tuple[str, ...]) -> list[dict]:
    if not specs:
        return []
    from distdebug.fault_injection.registry import resolve

    return [resolve(s) for s in specs]


def _run_dirs(runs: tuple[str, ...]) -> list[Path]:
    """The run directories RUN ... name (paths, or names under ./distdebug-runs), or the newest run."""
    from distdebug.artifacts.runs import resolve_run

    return [resolve_run(r) for r in runs] if runs else [resolve_run(None)]


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

    loaded = load_runs(_run_dirs(runs))
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
    return _gate(summary.findings, fail_on)


def _gate(findings: list, fail_on: str | None) -> int:
    """``--fail-on``: EXIT_FINDINGS and one line when a finding at or above the level is there, else 0."""
    from distdebug.findings import at_or_above, gate_line

    failing = at_or_above(findings, fail_on) if fail_on else []
    if failing:
        assert fail_on is not None
        print(f"distdebug: {gate_line(fail_on, failing)}; exit {EXIT_FINDINGS}", file=sys.stderr)
        return EXIT_FINDINGS
    return 0


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
    dirs = _run_dirs(runs)
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


@main.command("detectors", short_help="List the detectors: code, name, on by default or not, what each finds.")
@click.option("--options", "with_options", is_flag=True,
              help="Also list each detector's --detector-option keys, their defaults and meaning.")
def list_detectors(with_options: bool) -> int:
    """List the registered detectors: code, name, on by default or not, what it finds."""
    from distdebug import cards
    from distdebug.detectors import registry

    for name in registry.names():  # the registry's names, each read from its card (a test keeps them paired)
        card = cards.CARDS[name]
        click.echo(f"{card.code}  {name:22s} {'default' if card.default else 'opt-in ':8s} {card.title}")
        if with_options:
            for o in card.options:
                flag = f" (attach {o.flag})" if o.flag else ""
                click.echo(f"        --detector-option {name}.{o.key}=... default {o.default!r}{flag}: {o.help}")
    return 0


@main.command(short_help="What a finding means: its causes, the check and the fix.")
@click.argument("code_or_name", required=False)
def explain(code_or_name: str | None) -> int:
    """What a finding means, its likely causes, the check and the fix: CODE_OR_NAME is a finding's code (DD102)
    or its detector (nan_origin); none: every finding kind."""
    from distdebug import cards
    from distdebug.report import cardview

    if code_or_name is None:
        for card in cards.CARDS.values():
            click.echo(f"{card.code}  {card.name:22s} {card.title}")
        return 0
    found = cards.lookup(code_or_name)
    if found is None:
        raise UserError(f"no finding kind '{code_or_name}': give a code (DD101) or a name (nan_origin); "
                        "'distdebug explain' lists them", 2)
    click.echo(cardview.text(found))
    return 0


@main.command(short_help="Check the environment for distributed training, across ranks and nodes.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--bandwidth", is_flag=True, help="Also an all_reduce bandwidth sweep and a pairwise link matrix "
              "across the ranks (started like attach).")
@click.option("--nproc-per-node", "--nproc_per_node", "nproc_per_node", default=None,
              help="Check across this many ranks per node, started like attach (default with --bandwidth: "
                   "as attach). Without it and --bandwidth: this host only, no ranks.")
@click.option("--nnodes", default="1", show_default=True, help="Nodes: N or MIN:MAX.")
@click.option("--node-rank", "--node_rank", "node_rank", type=int, default=0, show_default=True,
              help="This node's rank (static rendezvous), as attach.")
@click.option("--rdzv-backend", "--rdzv_backend", "rdzv_backend", default="static", show_default=True,
              help="Rendezvous backend: static or c10d, as attach.")
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint", default="",
              help="Rendezvous HOST:PORT, as attach.")
@click.option("--master-addr", "--master_addr", "master_addr", default=None,
              help="Static rendezvous address, as attach.")
@click.option("--master-port", "--master_port", "master_port", type=int, default=None,
              help="Static rendezvous port, as attach.")
@click.option("--max-bytes", type=int, default=128 << 20, show_default=True,
              help="Largest all_reduce of the sweep (bytes; from 8 B, doubling).")
@click.option("--run-dir", type=click.Path(path_type=Path), default=None,
              help="Where the ranks' records go. Default: a new directory under ./distdebug-runs/.")
def doctor(as_json: bool, bandwidth: bool, nproc_per_node: str | None, max_bytes: int, run_dir: Path | None,
           **launcher: object) -> int:
    """Check the environment for distributed training: versions, GPUs and topology, dangerous
    NCCL/GLOO/MASTER variables, port, /dev/shm, open-file limit; across ranks and nodes, differences in
    variables and versions; with --bandwidth, bus bandwidth and the link matrix. Exits 1 on a fail."""

    from distdebug.doctor.checks import FAIL, local_checks

    if nproc_per_node is None and not bandwidth:
        checks = [c.to_dict() for c in local_checks()]
        result: dict = {"ranks": {"local": {"checks": checks}}, "differences": []}
        failed = any(c["status"] == FAIL for c in checks)
    else:
        from distdebug.launch.doctor import run_doctor

        result, failed = run_doctor(nproc_per_node=nproc_per_node, bandwidth=bandwidth, max_bytes=max_bytes,
                                    run_dir=run_dir, launcher=launcher)
    if as_json:
        click.echo(strictjson.dumps(result, indent=2))
    else:
        from rich.console import Console

        from distdebug.report.doctor_view import render

        out = Console()
        render(out if out.is_terminal else Console(width=160), result)
    return 1 if failed else 0


@main.command(short_help="DDP, FSDP and DeepSpeed pitfalls in a script's source (nothing runs).")
@click.argument("script", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def lint(script: Path, as_json: bool) -> int:
    """DDP, FSDP and DeepSpeed pitfalls in SCRIPT, read from its source (nothing runs): file:line, why it
    matters, the fix. Exits 1 if any is an error."""

    from distdebug.errors import UserError
    from distdebug.lint.static import ERROR, lint_file

    if not script.is_file():
        raise UserError(f"script not found: {script}", 2)
    findings = lint_file(script)
    if as_json:
        click.echo(strictjson.dumps([f.to_dict() for f in findings], indent=2))
    else:
        for f in findings:
            click.echo(f"{script}:{f.line}: {f.severity} [{f.rule}] {f.message}\n    why: {f.why}\n    fix: {f.fix}")
        click.echo(f"{len(findings)} finding(s) in {script}" if findings else f"no pitfalls found in {script}")
    return 1 if any(f.severity == ERROR for f in findings) else 0


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
    from distdebug.errors import UserError
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


if __name__ == "__main__":
    main()

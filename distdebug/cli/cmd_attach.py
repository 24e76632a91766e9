"""``distdebug attach``: run SCRIPT under torch's launcher, instrumented. distdebug's own options lead its
help; torchrun's (with torchrun's meaning) follow, in a section of their own."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from distdebug import envvars
from distdebug.artifacts.retention import size_text
from distdebug.cli.base import SEVERITIES_HELP, SIZE, gate, main
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

LAUNCHER_PARAMS = frozenset({"nproc_per_node", "nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id",
                             "rdzv_conf", "standalone", "max_restarts", "master_addr", "master_port", "module"})
"""torchrun's options that attach reads itself (the rest are launch.torchrun_options', prefixed)."""


class AttachCommand(click.Command):
    """attach's help: distdebug's own options first (what a user came for), then torchrun's, which keep
    torchrun's meaning and PET_* variables, in a section of their own (they came first, 90 lines of them)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from distdebug.launch.torchrun_options import PREFIX

        own: list[tuple[str, str]] = []
        launcher: list[tuple[str, str]] = []
        for param in self.get_params(ctx):
            row = param.get_help_record(ctx)
            if row is not None:
                name = param.name or ""
                (launcher if name in LAUNCHER_PARAMS or name.startswith(PREFIX) else own).append(row)
        with formatter.section("distdebug's options"):
            formatter.write_dl(own)
        with formatter.section("torchrun's options (torchrun's meaning; each also read from its PET_* variable)"):
            formatter.write_dl(launcher)


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


@main.command(cls=AttachCommand,
              short_help="Run SCRIPT on every rank under torch's launcher, instrumented; no code changes.",
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
@click.option("--run-dir-budget", type=SIZE, default=size_text(RUN_DIR_BUDGET), show_default=True,
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
                   "in pairs of units of steps (one with, one without, the order drawn per pair; the same steps on "
                   "every rank), and the report compares their wall and CPU times with a 95% interval.")
@click.option("--overhead-block", type=int, default=None, show_default="4 steps; 8 where CUDA is available",
              help="Steps per unit with --measure-overhead (each pair is a unit on and a unit off): 1 gives the most "
                   "pairs but charges what an on step leaves to the next (its caches, its young objects) to the off "
                   "one; more where work lands a step late (a GPU's queue: a step that reads nothing from the "
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
        return gate(findings, fail_on)
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

"""``distdebug attach``: torch's own elastic launcher, called as a library, with a bootstrap per rank.

The launcher is not copied or re-implemented: we build torchrun's argument list, let torch parse
it, point the workers at ``-m distdebug.launch.bootstrap`` and call ``torch.distributed.run.run``.
Everything else (rendezvous, restarts, signal handling, worker teardown) is torch's.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from distdebug import envvars
from distdebug.analysis.after_job import JobEnd, analyse, print_notes
from distdebug.analysis.teardown import how
from distdebug.analysis.teardown import summary_line as teardown_summary
from distdebug.artifacts import layout, runs
from distdebug.artifacts.reader import read_json
from distdebug.artifacts.writer import os_error_text, write_json_atomic
from distdebug.config import EXIT_HANG, EXIT_NEVER_ACTED, AttachConfig, parse_nnodes
from distdebug.detectors import registry
from distdebug.errors import UserError
from distdebug.launch import manifest as manifest_mod
from distdebug.launch import supervisor as supervisor_mod
from distdebug.launch.services import Services
from distdebug.report.fmt import format_finding

BOOTSTRAP_MODULE = "distdebug.launch.bootstrap"


@dataclass
class AttachResult:
    exit_code: int
    run_dir: Path
    message: str | None = None
    """One line about how the job ended when it failed (None on success)."""
    completed: bool = False
    """Every rank finished the script; the failure came after (at interpreter exit: results complete), or
    was attach's own verdict that a fault injected on purpose never acted."""


def torchrun_argv(cfg: AttachConfig, nproc_per_node: str) -> list[str]:
    """The torchrun command line equivalent to cfg, with the bootstrap as the training module."""
    argv = [
        "--nproc-per-node", nproc_per_node,
        "--nnodes", cfg.nnodes,
        "--node-rank", str(cfg.node_rank),
        "--rdzv-backend", cfg.rdzv_backend,
        "--rdzv-id", cfg.rdzv_id,
        "--max-restarts", str(cfg.max_restarts),
    ]
    if cfg.rdzv_endpoint:
        argv += ["--rdzv-endpoint", cfg.rdzv_endpoint]
    if cfg.rdzv_conf:
        argv += ["--rdzv-conf", cfg.rdzv_conf]
    if cfg.standalone:
        argv.append("--standalone")
    if cfg.master_addr is not None:
        argv += ["--master-addr", cfg.master_addr]
    if cfg.master_port is not None:
        argv += ["--master-port", str(cfg.master_port)]
    argv += cfg.torchrun_args
    target = cfg.target if cfg.module else str(Path(cfg.target).resolve())
    argv += ["-m", BOOTSTRAP_MODULE, target, *cfg.target_args]
    return argv


def _default_nproc() -> str:
    import torch

    return "gpu" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "2"


def _check_nproc(value: str) -> None:
    import torch

    if value == "gpu" and not torch.cuda.is_available():
        raise UserError("--nproc-per-node gpu: no CUDA GPU on this machine; give a number of ranks", 2)
    if value == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise UserError("--nproc-per-node xpu: no XPU on this machine; give a number of ranks", 2)


def _launcher_info(cfg: AttachConfig, nproc: str) -> dict[str, Any]:
    return {
        "nproc_per_node": nproc, "nnodes": cfg.nnodes, "node_rank": cfg.node_rank,
        "rdzv_backend": cfg.rdzv_backend, "rdzv_endpoint": cfg.rdzv_endpoint, "rdzv_id": cfg.rdzv_id,
        "standalone": cfg.standalone, "max_restarts": cfg.max_restarts,
        "master_addr": cfg.master_addr, "master_port": cfg.master_port, "torchrun_args": cfg.torchrun_args,
    }


PARITY_RECORDER = "distdebug.detectors.parity:ParityRecorder"


def _worker_env(cfg: AttachConfig, run_dir: Path, detectors: list[dict[str, Any]], env_checked: bool) -> None:
    """Set the DISTDEBUG_* contract in this process; torch's agent passes it to every worker."""
    os.environ[envvars.RUN_DIR] = str(run_dir)
    os.environ[envvars.DETECTORS] = json.dumps(detectors)
    os.environ[envvars.TARGET_IS_MODULE] = "1" if cfg.module else "0"
    os.environ[envvars.NODE_RANK] = str(cfg.node_rank)
    from distdebug.detectors.env_check import checked

    # what attach checked itself (_env_check); empty: nothing, a rank's env_check checks everything
    os.environ[envvars.ENV_CHECKED] = json.dumps(checked()) if env_checked else ""
    os.environ[envvars.STALL_TIMEOUT] = repr(float(cfg.stall_timeout))
    os.environ[envvars.STARTUP_TIMEOUT] = repr(float(cfg.startup_allowance))
    os.environ[envvars.RUN_DIR_BUDGET] = str(cfg.run_dir_budget)
    os.environ[envvars.DETERMINISTIC] = "1" if cfg.deterministic else "0"
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
    os.environ[envvars.INJECT] = json.dumps(cfg.inject)
    os.environ[envvars.REPLICA_GROUPS] = cfg.replica_groups or ""  # empty: the layout as discovered
    os.environ[envvars.MEASURE_OVERHEAD] = str(cfg.measure_overhead or "")
    if cfg.flight_recorder_entries > 0:
        # PyTorch's Flight Recorder: read when each process group is created; records gloo and nccl.
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(cfg.flight_recorder_entries))
    root = Path(__file__).resolve().parents[2]
    if not _installed(root):
        # Running from a source tree that is not installed: workers must still import the bootstrap.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)


def _env_check(node_rank: int) -> list[dict[str, Any]] | None:
    """The node's environment checks (detectors.env_check), made once by its launcher before the ranks start: each
    warn or fail printed (with its fix and the host) and returned as finding records for the node's file, with no
    rank yet (the rendezvous has not numbered them; ``_file_env_findings`` files them after the job). None: the
    checks could not run (said), and the ranks make them."""
    from distdebug.artifacts import schema
    from distdebug.detectors.env_check import node_findings

    host = socket.gethostname()
    try:
        found = node_findings([], where={"host": host, "node": node_rank})
    except Exception as e:  # a check is never worth a job
        print(f"distdebug: environment checks off in the launcher ({type(e).__name__}: {e}); the ranks make them",
              file=sys.stderr, flush=True)
        return None
    for f in found:
        fix = f"\ndistdebug:   fix: {f.fix}" if f.fix else ""
        print(f"distdebug[host {host}] {f.severity.value.upper()} {f.detector}: {f.subject}: {f.message}{fix}",
              file=sys.stderr, flush=True)
    for f in found:  # in the run's report, beside other nodes' findings: which host
        f.message = f"{f.message} (host {host})"
    return [schema.record(schema.FINDING, **f.to_dict()) for f in found]


def _file_env_findings(run_dir: Path, node_info: dict[str, Any], layout_map: dict[str, dict[str, Any]],
                       single_node: bool) -> None:
    """After the job: the launcher's environment findings filed under the global rank of the local rank 0 it
    started, appended to the run's findings, and taken out of the node's file (one place each). On one node
    that rank is 0 whether or not it lived to record its start (a rank that fails at once makes torch's agent
    stop the others, a local rank 0 still importing torch among them); on several, a node none of whose ranks
    recorded its start files them unnumbered (the message names the host). A disk that refuses the append
    leaves them in the node's file."""
    from distdebug.artifacts.writer import append_run_findings
    from distdebug.detectors.env_check import own_first_rank
    from distdebug.findings import Finding

    records = node_info.get("findings") or []
    if not records:
        return
    first = own_first_rank(layout_map, os.getpid())
    if first is None and single_node:
        first = 0
    found = [Finding.from_dict({**r, "ranks": [first] if first is not None else []}) for r in records]
    try:
        append_run_findings(run_dir, found)
    except OSError:
        return
    node_info.pop("findings", None)


def _installed(root: Path) -> bool:
    """Whether this interpreter finds distdebug without help (a wheel, or an editable install's finder in
    site-packages), as the workers will. In a checkout, its own distdebug.egg-info (left by an editable
    install into another environment) is seen only because cli.py put the checkout on this process's
    path: that is not an install."""
    checkout = (root / "pyproject.toml").is_file() and (root / "fault_injection").is_dir()
    return any(not (checkout and Path(str(d.locate_file(""))).resolve() == root)
               for d in metadata.distributions(name="distdebug"))


def _quiet_torch_launcher(level: str) -> None:
    lvl = getattr(logging, level.upper(), logging.CRITICAL)
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(lvl)


def _failure_message(err: Any) -> tuple[int, str]:
    """Exit code and one line from torch's ChildFailedError (the first failure is the root cause)."""
    rank, failure = err.get_first_failure()
    code = int(failure.exitcode)
    if code < 0:
        return 128 - code, f"rank {rank} was killed by {how(code)}"
    return code, f"rank {rank} exited with code {code}"


def attach(cfg: AttachConfig, argv: list[str] | None = None) -> AttachResult:
    """Run cfg.target under torch's elastic launcher with instrumentation; returns its exit code. In order: what
    runs (refused before any run directory is made: bad input leaves no empty run for `latest` to point at),
    the run directory and its records of the start, the side services around torch's launcher, the verdicts."""
    names, detectors = _detectors(cfg)
    torchrun, args, nproc = _launcher_args(cfg)
    label = Path(cfg.target).stem if not cfg.module else cfg.target.rsplit(".", 1)[-1]
    run_dir = runs.prepare_run_dir(cfg.run_dir if cfg.run_dir is not None else runs.new_run_dir(label))
    if cfg.run_dir is None:
        runs.mark_latest(run_dir)
    node_info, env_checked = _record_start(cfg, argv, run_dir, nproc, detectors, names)
    _worker_env(cfg, run_dir, detectors, env_checked=env_checked)
    end = JobEnd(exit_code=0, primary=cfg.node_rank == 0)
    with Services.for_launch(cfg, run_dir, getattr(args, "log_dir", None)) as services:
        code, message = _run_launcher(torchrun, args, end)
    return _finish(cfg, run_dir, end, code, message, services, node_info)


def _detectors(cfg: AttachConfig) -> tuple[list[str], list[dict[str, Any]]]:
    """The detectors' names and their resolved specs, with parity's recorder where asked for."""
    names = registry.chosen(cfg.detectors)
    if cfg.rerun_on_anomaly and "rerun" not in names:
        names = [*names, "rerun"]
    detectors = registry.resolve(names, cfg.detector_options, cfg.shorthand_options)
    if cfg.parity is not None:  # a recorder, not a detector: reached by its import path (detectors.parity)
        detectors.append({"target": PARITY_RECORDER, "params": {
            "twin": cfg.parity == "twin", **({"steps": cfg.parity_steps} if cfg.parity_steps else {})}})
    return names, detectors


def _launcher_args(cfg: AttachConfig) -> tuple[Any, Any, str]:
    """torch's launcher module, its parsed arguments and the ranks a node, checked by torch's own code."""
    nproc = cfg.nproc_per_node or _default_nproc()
    _check_nproc(nproc)
    import torch.distributed.run as torchrun

    _quiet_torch_launcher(cfg.launcher_log_level)
    args = torchrun.parse_args(torchrun_argv(cfg, nproc))
    try:
        # torch's own checks of its options (the grammar of -t/-r, --local-ranks-filter, --rdzv-conf, a
        # --logs-specs entry point), made by the code that will use them, before any run directory is made
        torchrun.config_from_args(args)
    except (ValueError, RuntimeError, AssertionError) as e:
        raise UserError(f"the launcher refused its options: {e}", 2) from None
    return torchrun, args, nproc


def _record_start(cfg: AttachConfig, argv: list[str] | None, run_dir: Path, nproc: str,
                  detectors: list[dict[str, Any]], names: list[str]) -> tuple[dict[str, Any], bool]:
    """The manifest (node 0's, or the first node's) and this node's file, with the environment check's findings
    made before any rank starts (a rank that fails at once cannot outrun its explanation); the node's record and
    whether the environment was checked here (the ranks then do not check it again)."""
    launcher = _launcher_info(cfg, nproc)
    if cfg.node_rank == 0 or not layout.manifest_path(run_dir).exists():
        _write_or_say(
            layout.manifest_path(run_dir),
            manifest_mod.build_manifest(
                argv=argv or sys.argv, target=cfg.target, target_args=cfg.target_args, module=cfg.module,
                launcher=launcher, detectors=detectors, run_dir=run_dir, faults=cfg.inject,
            ),
        )
    node_info: dict[str, Any] = {
        "node_rank": cfg.node_rank, "host": socket.gethostname(), "pid": os.getpid(),
        "started": time.time(), "launcher": launcher,
    }
    env_found = _env_check(cfg.node_rank) if "env_check" in names else None
    if env_found:
        node_info["findings"] = env_found
    _write_or_say(layout.node_path(run_dir, cfg.node_rank), node_info)
    return node_info, env_found is not None


def _run_launcher(torchrun: Any, args: Any, end: JobEnd) -> tuple[int, str | None]:
    """torch's launcher, to the job's end: its exit code and, for a failure, why in a few words."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        torchrun.run(args)
    except ChildFailedError as e:
        end.failures, end.first_failure = _failures(e)
        return _failure_message(e)
    except SignalException as e:
        return 128 + int(e.sigval), f"the launcher received {e.sigval.name}; ranks were stopped"
    except RendezvousError as e:
        return 1, f"rendezvous failed: {type(e).__name__}: {e}"
    except (ValueError, RuntimeError, AssertionError) as e:
        # torch's own validation of launcher options (e.g. a bad --rdzv-conf)
        return 2, f"the launcher refused to start: {e}"
    return 0, None


def _finish(cfg: AttachConfig, run_dir: Path, end: JobEnd, code: int, message: str | None, services: Services,
            node_info: dict[str, Any]) -> AttachResult:
    """Every run-level verdict, from the run loaded once; the exit code and line they give; the node's file and
    the manifest completed."""
    supervisor = services.supervisor
    end.exit_code = code
    end.hang_named = supervisor.verdict is not None and code != 0
    result = analyse(run_dir, end)
    for f in result.findings:
        print(format_finding(f), file=sys.stderr, flush=True)
    print_notes(result)
    if end.hang_named:
        assert supervisor.verdict is not None
        code, message = EXIT_HANG, supervisor_mod.summary_line(supervisor.verdict)
    elif result.completed:
        message = teardown_summary([f for f in result.findings if f.detector == "teardown"])
    elif code == 0 and result.never_acted:
        code, message = EXIT_NEVER_ACTED, never_acted_message(result.never_acted, result.why_not)
    try:
        _file_env_findings(run_dir, node_info, result.layout, parse_nnodes(cfg.nnodes)[1] == 1)
    except Exception as e:  # never worth the job's exit: they stay in the node's file, unfiled
        print(f"distdebug: could not file the environment findings ({type(e).__name__}: {e})", file=sys.stderr,
              flush=True)
    guard = services.guard
    node_info.update(ended=time.time(), exit_code=code, message=message,
                     volume=guard.summary_within(10.0) if guard is not None else None)
    _write_or_say(layout.node_path(run_dir, cfg.node_rank), node_info)
    if cfg.node_rank == 0:
        data = read_json(layout.manifest_path(run_dir)) or {}
        data.update(world_size=result.world_size, layout=result.layout)
        _write_or_say(layout.manifest_path(run_dir), data)
    return AttachResult(code, run_dir, message, result.completed or code == EXIT_NEVER_ACTED)


def _write_or_say(path: Path, data: dict[str, Any]) -> None:
    """One of the launcher's files; a full or failing disk loses it (said in one line), never the job or its
    exit code."""
    try:
        write_json_atomic(path, data)
    except OSError as e:
        print(f"distdebug: could not write {path.name} in the run directory ({os_error_text(e)}); the job goes on",
              file=sys.stderr, flush=True)


def never_acted_message(names: list[str], why: dict[str, list[str]]) -> str:
    """attach's line for exit 122: each fault with its own reasons (``not_acted`` records: the fault knows why);
    the generic line, and where to look, only for a fault that gave none."""
    from distdebug.analysis.summary import NO_REASON, never_acted_text

    head = f"the training exited 0, but the fault{'s' if len(names) > 1 else ''} injected on purpose never acted: "
    hint = "distdebug faults replay SCRIPT says which faults can act on a script"
    if not any(why.get(n) for n in names):
        return f"{head}{', '.join(names)} ({NO_REASON}; {hint})"
    return head + never_acted_text(names, why) + ("" if all(why.get(n) for n in names) else f" ({hint})")


def _failures(err: Any) -> tuple[dict[int, int], int | None]:
    """Each failed rank's exit status (negative: the signal that ended it) and torch's first failure."""
    try:
        failures = {int(rank): int(f.exitcode) for rank, f in err.failures.items()}
        return failures, int(err.get_first_failure()[0])
    except Exception:  # torch's error type changed: the analysis does without it
        return {}, None



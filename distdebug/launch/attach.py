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
from distdebug.artifacts import layout, runs
from distdebug.config import EXIT_HANG, AttachConfig, parse_nnodes
from distdebug.detectors import registry
from distdebug.errors import UserError
from distdebug.launch import manifest as manifest_mod
from distdebug.launch import supervisor as supervisor_mod

BOOTSTRAP_MODULE = "distdebug.launch.bootstrap"


@dataclass
class AttachResult:
    exit_code: int
    run_dir: Path
    message: str | None = None
    """One line about how the job ended when it failed (None on success)."""
    completed: bool = False
    """Every rank finished the script; the failure came after, at interpreter exit (results complete)."""


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
        "master_addr": cfg.master_addr, "master_port": cfg.master_port,
    }


def _worker_env(cfg: AttachConfig, run_dir: Path, detectors: list[str]) -> None:
    """Set the DISTDEBUG_* contract in this process; torch's agent passes it to every worker."""
    os.environ[envvars.RUN_DIR] = str(run_dir)
    os.environ[envvars.DETECTORS] = envvars.encode_list(detectors)
    os.environ[envvars.TARGET_IS_MODULE] = "1" if cfg.module else "0"
    os.environ[envvars.NODE_RANK] = str(cfg.node_rank)
    os.environ[envvars.STALL_TIMEOUT] = repr(float(cfg.stall_timeout))
    os.environ[envvars.FINGERPRINT_EVERY] = str(cfg.fingerprint_every)
    os.environ[envvars.STOP_ON_NAN] = "1" if cfg.stop_on_nan else "0"
    os.environ[envvars.DETERMINISTIC] = "1" if cfg.deterministic else "0"
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
    os.environ[envvars.SPIKE_THRESHOLD] = repr(float(cfg.spike_threshold))
    os.environ[envvars.SPIKE_WINDOW] = str(cfg.spike_window)
    os.environ[envvars.INJECT] = json.dumps(cfg.inject)
    os.environ[envvars.PROFILE_STEPS] = cfg.profile_steps
    os.environ[envvars.PROFILE_ON_FINDING] = str(cfg.profile_on_finding)
    if cfg.flight_recorder_entries > 0:
        # PyTorch's Flight Recorder: read when each process group is created; records gloo and nccl.
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(cfg.flight_recorder_entries))
    try:
        metadata.version("distdebug")
    except metadata.PackageNotFoundError:
        # Running from a source tree that is not installed: workers must still import the bootstrap.
        root = str(Path(__file__).resolve().parents[2])
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)


def _quiet_torch_launcher(level: str) -> None:
    lvl = getattr(logging, level.upper(), logging.CRITICAL)
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(lvl)


def _failure_message(err: Any) -> tuple[int, str]:
    """Exit code and one line from torch's ChildFailedError (the first failure is the root cause)."""
    rank, failure = err.get_first_failure()
    code = int(failure.exitcode)
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return 128 - code, f"rank {rank} was killed by {name}"
    return code, f"rank {rank} exited with code {code}"


def attach(cfg: AttachConfig, argv: list[str] | None = None) -> AttachResult:
    """Run cfg.target under torch's elastic launcher with instrumentation; returns its exit code."""
    detectors = registry.validate(cfg.detectors if cfg.detectors is not None else registry.default_specs())
    label = Path(cfg.target).stem if not cfg.module else cfg.target.rsplit(".", 1)[-1]
    run_dir = runs.prepare_run_dir(cfg.run_dir if cfg.run_dir is not None else runs.new_run_dir(label))
    if cfg.run_dir is None:
        runs.mark_latest(run_dir)

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    nproc = cfg.nproc_per_node or _default_nproc()
    _check_nproc(nproc)
    launcher = _launcher_info(cfg, nproc)
    if cfg.node_rank == 0 or not layout.manifest_path(run_dir).exists():
        manifest_mod.write_json_atomic(
            layout.manifest_path(run_dir),
            manifest_mod.build_manifest(
                argv=argv or sys.argv, target=cfg.target, target_args=cfg.target_args, module=cfg.module,
                launcher=launcher, detectors=detectors, run_dir=run_dir, faults=cfg.inject,
            ),
        )
    node_file = layout.node_path(run_dir, cfg.node_rank)
    node_info: dict[str, Any] = {
        "node_rank": cfg.node_rank, "host": socket.gethostname(), "pid": os.getpid(),
        "started": time.time(), "launcher": launcher,
    }
    manifest_mod.write_json_atomic(node_file, node_info)

    _worker_env(cfg, run_dir, detectors)
    _quiet_torch_launcher(cfg.launcher_log_level)
    args = torchrun.parse_args(torchrun_argv(cfg, nproc))
    supervisor = supervisor_mod.Supervisor(
        run_dir, stall_timeout=cfg.stall_timeout, on_hang=cfg.on_hang, node_rank=cfg.node_rank,
        expected_nodes=parse_nnodes(cfg.nnodes)[0],
    )
    supervisor.start()
    code, message, completed = 0, None, False
    first_failure: tuple[int, int] | None = None
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        code, message = _failure_message(e)
        first_failure = _first_failure(e)
        completed, teardown_message = _teardown_verdict(run_dir, e)
        message = teardown_message or message
    except SignalException as e:
        code, message = 128 + int(e.sigval), f"the launcher received {e.sigval.name}; ranks were stopped"
    except RendezvousError as e:
        code, message = 1, f"rendezvous failed: {type(e).__name__}: {e}"
    except (ValueError, RuntimeError, AssertionError) as e:
        # torch's own validation of launcher options (e.g. a bad --rdzv-conf)
        code, message = 2, f"the launcher refused to start: {e}"
    finally:
        supervisor.stop()
    if supervisor.verdict is not None and code != 0:
        code, message = EXIT_HANG, supervisor_mod.summary_line(supervisor.verdict)
    elif code != 0 and cfg.node_rank == 0 and not completed:
        _post_mortem(run_dir, first_failure)
    if cfg.node_rank == 0:
        _offline_replica_check(run_dir)
    node_info.update(ended=time.time(), exit_code=code, message=message)
    manifest_mod.write_json_atomic(node_file, node_info)
    if cfg.node_rank == 0:
        _record_layout(run_dir)
    return AttachResult(code, run_dir, message, completed)


def _teardown_verdict(run_dir: Path, err: Any) -> tuple[bool, str | None]:
    """(True, one line) when every failed rank had finished the script: it died at interpreter exit.

    The exit code is left as torch's launcher gave it; the finding says results are complete.
    """
    from distdebug.analysis.teardown import summary_line, teardown_findings
    from distdebug.artifacts.reader import load_run

    try:
        failures = {int(rank): int(f.exitcode) for rank, f in err.failures.items()}
        findings = teardown_findings(load_run(run_dir), failures, first=int(err.get_first_failure()[0]))
    except Exception as e:  # the verdict is a courtesy; the job's own failure stays what it is
        print(f"distdebug: could not read the ranks' end records: {type(e).__name__}: {e}", file=sys.stderr)
        return False, None
    if not findings:
        return False, None
    supervisor_mod.write_run_findings(run_dir, findings)
    for f in findings:
        print(supervisor_mod.format_finding(f), file=sys.stderr, flush=True)
    return True, summary_line(findings)


def _first_failure(err: Any) -> tuple[int, int] | None:
    """(rank, exit code) of torch's first failed rank; a negative code is the signal that ended it."""
    try:
        rank, failure = err.get_first_failure()
        return int(rank), int(failure.exitcode)
    except Exception:  # torch's error type changed: the diagnosis does without it
        return None


def _post_mortem(run_dir: Path, first_failure: tuple[int, int] | None = None) -> None:
    """After a failed job: explain a failed collective (a rank that left, a size mismatch) or a rank
    killed from outside, if any."""
    from distdebug.analysis.hang import diagnose
    from distdebug.artifacts.reader import load_run

    try:
        findings = diagnose(load_run(run_dir), first_failure)
    except Exception as e:  # diagnosis must not hide the job's own failure
        print(f"distdebug: could not diagnose the failure: {type(e).__name__}: {e}", file=sys.stderr)
        return
    if findings:
        supervisor_mod.write_run_findings(run_dir, findings)
        for f in findings:
            print(supervisor_mod.format_finding(f), file=sys.stderr, flush=True)


OFFLINE_CHECK_MAX_BYTES = 256 << 20
"""Snapshots larger than this in all are left to ``distdebug diff`` (it says so)."""


def _offline_replica_check(run_dir: Path) -> None:
    """After every job: the steps the online check did not exchange (the last few of a run that
    crashed, hung or never destroyed its process group) are compared from the snapshots."""
    from distdebug.analysis.diff import first_divergent_step, load_snapshots
    from distdebug.artifacts.reader import load_run
    from distdebug.findings import Finding, Severity

    try:
        run = load_run(run_dir)
        if any(f.get("detector") == "replica_divergence" for f in run.all_findings()):
            return  # the online check already named the first divergent step
        size = sum(p.stat().st_size for p in run_dir.glob(f"rank-*/{layout.FINGERPRINTS}"))
        if not size:
            return
        if size > OFFLINE_CHECK_MAX_BYTES:
            print(f"distdebug: fingerprint snapshots are {size >> 20} MiB; run 'distdebug diff {run_dir}' "
                  "to check the last steps offline", file=sys.stderr)
            return
        found = first_divergent_step(load_snapshots(run_dir))
    except Exception as e:  # an offline check must never change the job's outcome
        print(f"distdebug: offline replica check failed: {type(e).__name__}: {e}", file=sys.stderr)
        return
    if found is None:
        return
    step, diffs = found
    culprits = sorted({r for d in diffs for r in d.ranks})
    majority = all(d.by_majority for d in diffs) and len({r for d in diffs for g in d.groups for r in g}) >= 3
    who = f"rank(s) {culprits} differ from the majority" if majority else f"ranks {culprits} disagree"
    finding = Finding(
        severity=Severity.ERROR, detector="replica_divergence", ranks=culprits, step=step, subject=diffs[0].tensor,
        message=f"replicas diverged at step {step} (found from the snapshots after the job): {len(diffs)} "
                f"tensor(s) differ ({', '.join(d.tensor for d in diffs[:10])}); {who}",
        evidence={"tensors": [d.to_dict() for d in diffs[:200]], "count": len(diffs)},
        fix=f"'distdebug diff {run_dir} --step {step}' lists them all. Usual causes: a rank-local update "
            "(unsynchronised gradients or buffers), silent data corruption, non-deterministic kernels",
    )
    supervisor_mod.write_run_findings(run_dir, [finding])
    print(supervisor_mod.format_finding(finding), file=sys.stderr, flush=True)


def _record_layout(run_dir: Path) -> None:
    """Add the realised world size and rank -> node/host/pid layout to the manifest.

    Only known after rendezvous (elastic ``MIN:MAX`` node counts, c10d's own node ranks), so it
    is read back from the ranks' ``start`` records visible from this node.
    """
    from distdebug.artifacts.reader import load_run

    run = load_run(run_dir)
    layout_map: dict[str, Any] = {}
    world_size = None
    for rank, stream in sorted(run.ranks.items()):
        start = next((r for r in reversed(stream.records) if r.get("kind") == "start"), None)
        if start is None:
            continue
        world_size = start.get("world_size", world_size)
        layout_map[str(rank)] = {k: start.get(k) for k in ("node", "local_rank", "host", "pid", "attempt")}
    data = run.manifest or {}
    data.update(world_size=world_size, layout=layout_map)
    manifest_mod.write_json_atomic(layout.manifest_path(run_dir), data)

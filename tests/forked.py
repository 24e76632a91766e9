"""attach's run of a script with its ranks forked from the test process (tier 2): no launcher, no torch import per
rank (issue 63: the suite's time is mostly torch's imports in CLI launches, about 6 s of CPU each).

For tests that prove numbers (parity's pairs and seeds), not the CLI: the run directory is what attach makes of
the same script (the same manifest and node record, the same DISTDEBUG_* contract handed to each rank, each rank
run by the bootstrap's own ``main``, the same verdicts after the job), but torch's launcher is left out: each rank
is a fork of the test process with the environment torchrun gives its workers. What the launcher itself does
(its options, restarts, signals, a rank killed, a hang) is proven by the CLI tests of tests/e2e; attach's pairs
through the CLI by tests/e2e/test_parity.py.
"""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

from tests.helpers import free_port, kill_tree


def _rank(env: dict[str, str], argv: list[str]) -> None:
    """One rank: the environment torchrun's agent gives a worker, then the bootstrap, as attach runs it."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        sys.argv = argv
        from distdebug.launch import bootstrap

        try:
            bootstrap.main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 (reported by the exit code; the traceback is on stderr)
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def forked_attach(run_dir: Path, nproc: int, script: Path, args: list[str], *, parity: str | None = None,
                  inject: tuple[str, ...] = (), timeout: float = 300) -> list[int]:
    """``distdebug attach [--parity MODE] [--inject SPEC] --nproc-per-node NPROC --run-dir RUN_DIR SCRIPT ARGS``, its
    ranks forked here; each rank's exit code. The after-job verdicts are attach's own (launch.attach._finish)."""
    from distdebug.analysis.after_job import JobEnd
    from distdebug.artifacts import runs
    from distdebug.config import AttachConfig
    from distdebug.fault_injection.registry import resolve
    from distdebug.launch import attach as launch

    cfg = AttachConfig(target=str(script), target_args=list(args), run_dir=run_dir, parity=parity,
                       nproc_per_node=str(nproc), inject=[resolve(s) for s in inject])
    names, detectors = launch._detectors(cfg)
    run_dir = runs.prepare_run_dir(run_dir)
    argv = ["distdebug", "attach", *([f"--parity={parity}"] if parity else []), *(f"--inject={s}" for s in inject),
            "--nproc-per-node", str(nproc), str(script), *args]
    node_info, env_checked = launch._record_start(cfg, argv, run_dir, str(nproc), detectors, names)
    saved = dict(os.environ)
    try:
        launch._worker_env(cfg, run_dir, detectors, env_checked=env_checked)
        contract = dict(os.environ)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    port = str(free_port())
    pids = []
    for rank in range(nproc):
        env = {**contract, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank),
               "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
               "TORCHELASTIC_USE_AGENT_STORE": "False", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
               "DISTDEBUG_PARENT_WATCH": "0"}
        pid = os.fork()
        if pid == 0:
            _rank(env, ["bootstrap", str(script), *args])
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(codes) < len(pids):
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                raise AssertionError(f"forked attach of {script.name} {args} timed out after {timeout}s")
            time.sleep(0.02)
    finally:
        for pid in pids:
            if pid not in codes:
                kill_tree(pid)
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:  # reaped by kill_tree's wait
                    pass
    out = [codes[pid] for pid in pids]
    end = JobEnd(exit_code=max(out, key=abs), primary=True)
    services = types.SimpleNamespace(supervisor=types.SimpleNamespace(verdict=None), guard=None)
    launch._finish(cfg, run_dir, end, end.exit_code, None, services, node_info)  # type: ignore[arg-type]
    return out

"""``distdebug doctor`` across ranks: the doctor's worker (``distdebug/doctor/worker.py``) runs under attach
(same launcher, same run directory, same clean-up), and rank 0's ``doctor.json`` is read back. A launch, so
it lives with the launcher: the doctor's folder holds the checks and the worker, below the launcher."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from distdebug import strictjson
from distdebug.artifacts import layout, runs
from distdebug.errors import UserError


def run_doctor(*, nproc_per_node: str | None, bandwidth: bool, max_bytes: int, run_dir: Path | None,
               launcher: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(rank 0's result, whether anything failed)."""
    import distdebug.doctor
    from distdebug.config import AttachConfig
    from distdebug.doctor.checks import FAIL
    from distdebug.launch.attach import attach

    made = run_dir is None
    run_dir = run_dir or runs.new_run_dir("doctor")  # claimed by mkdir: two doctors never share one
    out = layout.doctor_path(Path(run_dir).resolve())
    args = ["--out", str(out), "--max-bytes", str(max_bytes)] + (["--bandwidth"] if bandwidth else [])
    worker = Path(distdebug.doctor.__file__).with_name("worker.py")
    try:
        cfg = AttachConfig(target=str(worker), target_args=args, run_dir=run_dir, nproc_per_node=nproc_per_node,
                           detectors=["env_check"], **launcher)  # type: ignore[arg-type]
        result = attach(cfg, argv=["distdebug", "doctor", *sys.argv[2:]])
    except UserError:
        if made:  # refused before anything ran: no empty run left behind (nor an empty runs root) for report
            for folder in (Path(run_dir), Path(run_dir).parent):
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only ever removes an empty folder
        raise
    if not out.is_file():
        raise UserError(f"the doctor's ranks did not finish (exit code {result.exit_code}"
                        f"{': ' + result.message if result.message else ''}); see: distdebug report {run_dir}")
    data = strictjson.loads(out.read_text())
    data["run_dir"] = str(run_dir)
    failed = result.exit_code != 0 or any(c["status"] == FAIL for r in data["ranks"].values() for c in r["checks"])
    return data, failed

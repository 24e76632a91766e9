"""The run manifest: what ran, where, with which versions and environment (secrets redacted)."""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from distdebug.artifacts.redact import redact_argv, redact_env
from distdebug.artifacts.schema import MANIFEST_SCHEMA, SCHEMA_VERSION


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Any]:
    """Versions without importing deepspeed (slow); torch is already imported by the launcher."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "deepspeed": _dist_version("deepspeed"),
        "distdebug": _dist_version("distdebug"),
        "cuda": torch.version.cuda,
        "cudnn": None,
        "nccl": None,
        "gpus": 0,
    }
    if torch.cuda.is_available():
        info["gpus"] = torch.cuda.device_count()
        info["cudnn"] = torch.backends.cudnn.version()
        try:
            info["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:
            info["nccl"] = None
    return info


def build_manifest(*, argv: list[str], target: str, target_args: list[str], module: bool,
                   launcher: dict[str, Any], detectors: list[dict[str, Any]], run_dir: Path,
                   faults: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "schema": MANIFEST_SCHEMA,
        "v": SCHEMA_VERSION,
        "run_dir": str(run_dir),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": redact_argv(argv),
        "cwd": os.getcwd(),
        "target": target,
        "target_args": redact_argv(target_args),
        "module": module,
        "launcher": launcher,
        "world_size": None,  # filled in from the ranks' start records when the run ends
        "layout": {},
        "detectors": [d["target"] for d in detectors],
        "detector_options": {d["target"]: d["params"] for d in detectors if d.get("params")},
        "faults": faults or [],
        "host": socket.gethostname(),
        "python_executable": sys.executable,
        "versions": versions(),
        "env": redact_env(dict(os.environ)),
    }


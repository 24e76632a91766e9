"""The run manifest: what ran, where, with which versions and environment (secrets redacted)."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from distdebug.artifacts.schema import MANIFEST_SCHEMA, SCHEMA_VERSION

SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")
REDACTED = "<redacted>"


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """Copy of env with the values of secret-looking names replaced; names are kept (they help)."""
    return {k: (REDACTED if is_secret(k) else v) for k, v in sorted(env.items())}


def redact_argv(argv: list[str]) -> list[str]:
    """``--api-key X`` / ``--token=X`` in a command line are secrets too."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if arg.startswith("-") and is_secret(arg.split("=", 1)[0]):
            if "=" in arg:
                out.append(arg.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
    return out


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
                   launcher: dict[str, Any], detectors: list[str], run_dir: Path,
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
        "detectors": detectors,
        "faults": faults or [],
        "host": socket.gethostname(),
        "python_executable": sys.executable,
        "versions": versions(),
        "env": redact_env(dict(os.environ)),
    }


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)

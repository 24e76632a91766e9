"""The one contract between the launcher and its ranks: every DISTDEBUG_* variable, in one place.

The launcher sets these in its own environment before calling torch's elastic launcher, which
hands its environment to every worker process unchanged.
"""

from __future__ import annotations

import os

RUN_DIR = "DISTDEBUG_RUN_DIR"
"""Absolute path of the run directory (shared by all ranks of this node)."""

DETECTORS = "DISTDEBUG_DETECTORS"
"""JSON list of ``{"target": name or file.py:Class / module:Class, "params": {...}}``: the detectors
of the run, each with its options (the fields of its config dataclass), as ``--inject`` sends faults."""

TARGET_IS_MODULE = "DISTDEBUG_TARGET_IS_MODULE"
"""``1`` when the target was given with ``-m`` (run as a module, like ``python -m``)."""

NODE_RANK = "DISTDEBUG_NODE_RANK"
"""The ``--node-rank`` this launcher was given (c10d rendezvous may assign another group rank)."""

ENV_CHECKED = "DISTDEBUG_ENV_CHECKED"
"""JSON of the NCCL_*/TORCH_NCCL_*/GLOO_* variables the node's launcher checked (env_check) before it started the
ranks: a rank checks again only those whose value changed since (``detectors.env_check``)."""

PARENT_WATCH = "DISTDEBUG_PARENT_WATCH"
"""``0`` disables the watchdog that ends a rank whose launcher died (default on)."""

STALL_TIMEOUT = "DISTDEBUG_STALL_TIMEOUT"
"""Seconds without progress (no step, no collective finished) after which a rank dumps its
stacks and Flight Recorder buffer; ``0`` turns stall detection off."""

STARTUP_TIMEOUT = "DISTDEBUG_STARTUP_TIMEOUT"
"""Seconds without progress allowed to a rank before its first step finishes (``--startup-timeout``;
default: the launcher's start-up allowance for its stall timeout)."""

WAKE_DIR = "DISTDEBUG_WAKE_DIR"
"""A node-local folder (the launcher's temporary directory) where each rank keeps the pipe its watchdog waits
on; the launcher's relay writes to it when ``distdebug stacks`` asks (runtime.wake). Unset: ranks poll."""

RUN_DIR_BUDGET = "DISTDEBUG_RUN_DIR_BUDGET"
"""Bytes of the run directory each rank may fill (``--run-dir-budget``); ``0`` or unset: unbounded."""

VOLUME_WINDOW = "DISTDEBUG_VOLUME_WINDOW_S"
"""Seconds over which the launcher's log-volume guard measures what the job writes (default
``config.VOLUME_WINDOW_S``); read by the launcher only."""

DETERMINISTIC = "DISTDEBUG_DETERMINISTIC"
"""``1``: seed every generator and turn on torch's deterministic algorithms before the script."""

INJECT = "DISTDEBUG_INJECT"
"""JSON list of ``{"target": "module:Class", "params": {...}}``: faults to run in every rank
(``attach --inject``), built before the detectors so that they act first."""

DEBUG = "DISTDEBUG_DEBUG"
"""Set (to anything): the CLI lets distdebug's own traceback through for an internal error."""

DEVICE_PATH = "DISTDEBUG_DEVICE_PATH"
"""``1``: CPU tensors take the fingerprint's device path too (the same values, computed with torch
kernels and read in the step's one read): the tests count on CPU what a GPU run reads."""

REPLICA_GROUPS = "DISTDEBUG_REPLICA_GROUPS"
"""``attach --replica-groups``: ``0,2;1,3``, the data-parallel groups, overriding the inferred layout."""

MEASURE_OVERHEAD = "DISTDEBUG_MEASURE_OVERHEAD"
"""``attach --measure-overhead``: steps per unit of the in-job A/B (runtime.overhead); empty or 0: off."""

STATUS = "DISTDEBUG_STATUS"
"""``0``: no status line from ``attach`` even on a terminal (launch.status)."""

REPLAY_BACKUP = "DISTDEBUG_REPLAY_BACKUP"
"""Set by ``faults replay SCRIPT`` on its clean run only: the folder where the probe keeps, before the first
torch.save to each path outside the replay's work dir, whether the path existed and the file that was there
(fault_injection.sandbox.before_save), so that the replay puts it back between runs."""

ALL = (RUN_DIR, DETECTORS, TARGET_IS_MODULE, NODE_RANK, ENV_CHECKED, PARENT_WATCH, STALL_TIMEOUT, STARTUP_TIMEOUT,
       DETERMINISTIC, INJECT, REPLICA_GROUPS, MEASURE_OVERHEAD, REPLAY_BACKUP)


def device_path_forced() -> bool:
    """Read at each fingerprinting (a few times a step), from the environment as it is now: a test
    sets and clears it in one process."""
    return os.environ.get(DEVICE_PATH) == "1"


def encode_list(items: list[str]) -> str:
    return ",".join(items)


def decode_list(value: str | None) -> list[str]:
    if not value:
        return []
    return [item.strip() for item in value.split(",") if item.strip()]


def decode_specs(value: str | None) -> list[dict]:
    """DETECTORS as sent by the launcher; a bare comma-separated list of names is taken too (no options)."""
    import json

    if not value:
        return []
    if value.lstrip().startswith("["):
        return list(json.loads(value))
    return [{"target": name, "params": {}} for name in decode_list(value)]


def get(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)
